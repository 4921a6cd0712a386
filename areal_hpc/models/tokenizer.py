"""A Qwen2-style byte-level BPE tokenizer trained offline on the text it will see (the caller's corpus:
the tasks' prompts and answers, see ``data.registry.corpus_for_tokenizer``), with the special tokens and
chat template of a chat family (``models.chat_families``: ours by default, or Qwen3's, Llama 3's, Gemma 3's).

It is built in exactly the form transformers' ``Qwen2Tokenizer`` rebuilds on load (same pre-tokenizer
regex, byte-level alphabet, NFC normaliser), so save -> load gives identical ids and text, whatever the
model's architecture; digits are single tokens, as in Qwen2, which keeps arithmetic learnable by a tiny
model. Every family's tokenizer is byte-level (the real Gemma 3 one is SentencePiece): only the special
tokens and the template are the family's.
"""

import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from areal_hpc.models.chat_families import DEFAULT_FAMILY, ENDOFTEXT, IM_END, IM_START, chat_family

PAD = ENDOFTEXT
VOCAB_MULTIPLE = 16  # the vocabulary's size is a multiple of this (tensor parallelism up to 16 splits it)
__all__ = ["IM_END", "IM_START", "PAD", "VOCAB_MULTIPLE", "build_tokenizer"]


def build_tokenizer(corpus: list[str], vocab_size: int = 1024, family: str = DEFAULT_FAMILY) -> Qwen2Tokenizer:
    """Train a byte-level BPE on ``corpus`` and wrap it as a Hugging Face Qwen2Tokenizer carrying the special
    tokens, end-of-turn token (``eos_token``) and chat template of ``family``."""
    chat = chat_family(family)
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*chat.specials, *chat.text_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus + list(chat.role_words), trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab, merges = trained["vocab"], [tuple(m) for m in trained["merges"]]
    # Reserved special tokens fill the vocabulary up to a multiple of VOCAB_MULTIPLE (as Qwen's do):
    # tensor-parallel ranks split it evenly, whatever text the tokenizer was trained on.
    reserved = [chat.reserved.format(i) for i in range(-len(vocab) % VOCAB_MULTIPLE)]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token=chat.eos,
        pad_token=chat.pad,
        bos_token=chat.bos,
        unk_token=None,
        additional_special_tokens=[t for t in chat.specials if t != chat.pad] + reserved,
    )
    # Qwen3's tags are tokens of their own that decode as text (not special): the proxy parses them
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in chat.text_tokens])
    tokenizer.chat_template = chat.template
    return tokenizer
