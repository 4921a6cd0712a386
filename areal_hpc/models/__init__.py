"""Models: the tiny offline Qwen2 model and tokenizer, and the local Hugging Face loader."""
