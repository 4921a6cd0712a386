"""Training engines behind one ``TrainEngine`` protocol (``base``): the PyTorch-native engine (``torch/``)
and Megatron-core (``megatron/``). Engines import nothing above them; see docs/architecture.md."""
