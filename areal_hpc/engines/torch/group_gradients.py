"""Gradients summed across training groups of different shapes (``parallel.groups``), then clipped.

Each group has already reduced its own gradients (over its replicas, its tensor-parallel shards and
pipeline stages stay apart). Their layouts differ, so the sum goes through full tensors: every rank
of a group takes part in gathering each of its parameters' gradients whole, the group's first replica
and tensor-parallel rank (tp = dp = 0) writes them into one flat buffer holding the whole model under
Hugging Face names, one all-reduce over the trainer ranks sums the groups' buffers, and every rank
takes its shard back out. The gradient norm is the buffer's, the same number on every rank, so every
group clips by the same factor and the replicas stay equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from areal_hpc.parallel.mesh import TrainMesh


class GroupGradientSum:
    """Collective over the trainer ranks; built once (it learns every group's parameter names)."""

    def __init__(self, model: torch.nn.Module, mesh: TrainMesh):
        self.mesh = mesh
        tied = getattr(model.config, "tie_word_embeddings", False)
        embedding = f"{model.base_model_prefix}.embed_tokens.weight"
        # a pipeline's last stage holds the tied head as its own parameter, with the embedding's gradient
        self.canonical = {"lm_head.weight": embedding} if tied else {}
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        mine = {self.canonical.get(name, name): tuple(p.shape) for name, p in self.params}
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        shapes = {name: shape for ranks in every for name, shape in ranks.items()}
        self.slots, total = {}, 0
        for name in sorted(shapes):
            size = torch.Size(shapes[name]).numel()
            self.slots[name] = (total, total + size, shapes[name])
            total += size
        self.total = total
        self.writes = mesh.coords["dp"] == mesh.coords["tp"] == 0

    def __call__(self, max_norm: float) -> torch.Tensor:
        """Sum every parameter's gradient over the groups, scale to at most ``max_norm``; the norm."""
        flat = torch.zeros(self.total, dtype=torch.float32, device=self.mesh.device)
        for name, p in self.params:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            whole = grad.full_tensor() if isinstance(grad, DTensor) else grad  # collective within the group
            if self.writes and name not in self.canonical:
                start, end, _ = self.slots[name]
                flat[start:end] = whole.reshape(-1).float()
        dist.all_reduce(flat)
        norm = torch.linalg.vector_norm(flat, dtype=torch.float64)  # float32 loses ~1e-5 over a million terms
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        if coef < 1.0:
            flat.mul_(coef)
        for name, p in self.params:
            start, end, shape = self.slots[self.canonical.get(name, name)]
            whole = flat[start:end].view(shape).to(p.dtype)
            if isinstance(p, DTensor):  # this rank's shard of the sum, cut locally
                p.grad = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
            else:
                p.grad = whole.clone()
        return norm
