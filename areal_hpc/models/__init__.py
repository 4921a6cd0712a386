"""Models: the tiny offline Qwen2 model and tokenizer, and the local Hugging Face loader."""

from transformers.utils import logging as _hf_logging

# Per-shard progress bars are noise next to our own progress display.
_hf_logging.disable_progress_bar()
