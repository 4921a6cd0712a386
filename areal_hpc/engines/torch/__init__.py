"""The PyTorch-native engine: a Hugging Face model parallelised with DTensor TP, FSDP2 or replicate,
pipeline stages, experts over ep and context shards (``actor.engine=torch``)."""
