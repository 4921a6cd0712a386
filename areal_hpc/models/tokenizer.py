"""A Qwen2-style byte-level BPE tokenizer trained offline on the text it will see (the caller's corpus:
the tasks' prompts and answers, see ``data.registry.corpus_for_tokenizer``).

It is built in exactly the form transformers' ``Qwen2Tokenizer`` rebuilds on load (same
pre-tokenizer regex, byte-level alphabet, NFC normaliser), so save -> load gives identical ids and
text; digits are single tokens, as in Qwen2, which keeps arithmetic learnable by a tiny model.
"""

import json

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VOCAB_MULTIPLE = 16  # the vocabulary's size is a multiple of this (tensor parallelism up to 16 splits it)

# Rendered with whitespace trimming, so every newline is written explicitly.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(corpus: list[str], vocab_size: int = 1024) -> Qwen2Tokenizer:
    """Train a byte-level BPE on ``corpus`` and wrap it as a Hugging Face Qwen2Tokenizer."""
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
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus + ["system", "user", "assistant"], trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab, merges = trained["vocab"], [tuple(m) for m in trained["merges"]]
    # Reserved special tokens fill the vocabulary up to a multiple of VOCAB_MULTIPLE (as Qwen's do):
    # tensor-parallel ranks split it evenly, whatever text the tokenizer was trained on.
    reserved = [f"<|reserved_{i}|>" for i in range(-len(vocab) % VOCAB_MULTIPLE)]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END, *reserved],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
