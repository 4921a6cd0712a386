"""Gradients summed across training groups of different shapes (``parallel.groups``), then clipped.

Each group has already reduced its own gradients (over its replicas, its tensor-parallel shards and
pipeline stages stay apart). Their layouts differ, so the sum goes through full tensors, a bucket of
parameters at a time (the whole model under Hugging Face names, cut into buckets the same way on every
rank): every rank of a group takes part in gathering each of its parameters' gradients whole; one
writer per pipeline stage of each group (its first rank: dp = tp = 0) writes them into the bucket; the
writers sum their buckets in one all-reduce among themselves (the traffic between pools); each writer
broadcasts the sum to the other ranks of its stage, and every rank takes its shard back out. The
gradient norm is the summed buckets', the same number on every rank, so every group clips by the same
factor and the replicas stay equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from areal_hpc.parallel.mesh import TrainMesh

BUCKET_ELEMENTS = 64 * 2**20  # 256 MiB of float32 gradients in flight at a time


class MixedGradientSum:
    """Collective over the trainer ranks; built once (it learns every group's parameter names)."""

    def __init__(self, model: torch.nn.Module, mesh: TrainMesh, bucket_elements: int | None = None):
        self.mesh, bucket_elements = mesh, bucket_elements or BUCKET_ELEMENTS
        tied = getattr(model.config, "tie_word_embeddings", False)
        embedding = f"{model.base_model_prefix}.embed_tokens.weight"
        # a pipeline's last stage holds the tied head as its own parameter, with the embedding's gradient
        canonical = {"lm_head.weight": embedding} if tied else {}
        self.held: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.held.setdefault(canonical.get(name, name), []).append((name, p))
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, {name: tuple(pairs[0][1].shape) for name, pairs in self.held.items()})
        shapes = {name: shape for ranks in every for name, shape in ranks.items()}
        self.buckets: list[list[tuple[str, int, int, tuple]]] = [[]]  # (name, start, end, shape) in the bucket
        used = 0
        for name in sorted(shapes):
            size = torch.Size(shapes[name]).numel()
            if used and used + size > bucket_elements:
                self.buckets.append([])
                used = 0
            self.buckets[-1].append((name, used, used + size, shapes[name]))
            used += size
        self.links = mesh.links

    def __call__(self, max_norm: float) -> torch.Tensor:
        """Sum every parameter's gradient over the groups, scale to at most ``max_norm``; the norm."""
        squares = torch.zeros((), dtype=torch.float64)
        for bucket in self.buckets:
            flat = torch.zeros(bucket[-1][2], dtype=torch.float32, device=self.mesh.device)
            for canonical, start, end, _ in bucket:
                for name, p in self.held.get(canonical, ()):
                    grad = p.grad if p.grad is not None else torch.zeros_like(p)
                    whole = grad.full_tensor() if isinstance(grad, DTensor) else grad  # collective within the group
                    if self.links.writes and name == canonical:
                        flat[start:end] = whole.reshape(-1).float()
            if self.links.writes:
                dist.all_reduce(flat, group=self.links.writers)
            if self.links.stage is not None:
                dist.broadcast(flat, src=self.links.stage_writer, group=self.links.stage)
            squares += torch.linalg.vector_norm(flat, dtype=torch.float64).cpu() ** 2  # float32 loses ~1e-5 here
            for canonical, start, end, shape in bucket:
                for _, p in self.held.get(canonical, ()):
                    whole = flat[start:end].view(shape).to(p.dtype)
                    if isinstance(p, DTensor):  # this rank's shard of the sum, cut locally
                        p.grad = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
                    else:
                        p.grad = whole.clone()
        norm = squares.sqrt()
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        if coef < 1.0:
            for pairs in self.held.values():
                for _, p in pairs:
                    p.grad.mul_(coef)
        return norm
