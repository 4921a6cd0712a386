"""RMSNorm for Megatron's local layer spec (no Transformer Engine, no Apex): torch's ``RMSNorm`` with
the constructor Megatron's norms take, its weight marked ``sequence_parallel`` as Megatron's fused
norms mark theirs. Under sequence parallelism each TP rank normalises its own slice of the tokens, so
the weight's gradient is partial; ``finalize_model_grads`` sums the gradients of weights so marked
over the TP ranks. (Megatron's ``WrappedTorchNorm`` refuses sequence parallelism for want of the mark.)
"""

from __future__ import annotations

import torch


class MarkedRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
