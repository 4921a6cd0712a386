"""The Megatron-core engine (``actor.engine=megatron``): Hugging Face weights converted to Megatron's
GPTModel, its own TP/SP/PP/CP/EP and FSDP, and the CPU shim that lets it run on gloo."""
