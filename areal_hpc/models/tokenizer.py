"""A Qwen2-style byte-level BPE tokenizer trained offline on the tasks' own text.

It is built in exactly the form transformers' ``Qwen2Tokenizer`` rebuilds on load (same
pre-tokenizer regex, byte-level alphabet, NFC normaliser), so save -> load gives identical ids and
text; digits are single tokens, as in Qwen2, which keeps arithmetic learnable by a tiny model.
"""

import json

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from areal_hpc.data.tasks import corpus_for_tokenizer

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Rendered with whitespace trimming, so every newline is written explicitly.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(vocab_size: int = 1024, seed: int = 0) -> Qwen2Tokenizer:
    """Train a byte-level BPE on the task corpus and wrap it as a Hugging Face Qwen2Tokenizer."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # merges fit the text the model will see: every task's prompts and answers, plus the chat roles
    bpe.train_from_iterator(corpus_for_tokenizer(seed) + ["system", "user", "assistant"], trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab, merges = trained["vocab"], [tuple(m) for m in trained["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=merges, eos_token=IM_END, pad_token=PAD, unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
