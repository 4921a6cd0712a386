"""RMSNorm for Megatron's local layer spec (no Transformer Engine, no Apex): torch's ``RMSNorm`` with
the constructor Megatron's norms take, its weight marked ``sequence_parallel`` as Megatron's fused
norms mark theirs. Under sequence parallelism each TP rank normalises its own slice of the tokens, so
the weight's gradient is partial; ``finalize_model_grads`` sums the gradients of weights so marked
over the TP ranks. (Megatron's ``WrappedTorchNorm`` refuses sequence parallelism for want of the mark.)

With ``layernorm_zero_centered_gamma`` (Gemma) the weight w is applied as 1 + w, in float32 as Hugging
Face's Gemma RMSNorm does (1 + w in bfloat16 would round a small w away), then cast back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class MarkedRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.zero_centered = config.layernorm_zero_centered_gamma
        if self.zero_centered:
            torch.nn.init.zeros_(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return super().forward(x)
        normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
