"""Each rank's part of a Hugging Face checkpoint, read straight from its safetensors files into the model
the rank holds: a model built on the meta device (``models.hf.model_skeleton``) and parallelised there
(pipeline stage kept, TP DTensors, FSDP2 shards, experts over ep) is made real on the rank's device, then
every parameter takes the slice of its stored tensor that its placements give it, cast to its dtype. No rank
reads or allocates a tensor it does not keep, and each slice is read in blocks of rows of at most ``READ_BYTES``:
a rank's peak is its shard plus about two blocks (the block read, and the file's pages mapped while reading it).
"""

from __future__ import annotations

import math
from itertools import chain

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from areal_hpc.models.hf import stored_name
from areal_hpc.models.hub_checkpoint import HubCheckpoint, Index

READ_BYTES = 4 << 20


def local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, Index | None]:
    """(the tensor this rank holds, its place in the full tensor: None for the whole of it)."""
    if not isinstance(tensor, DTensor):
        return tensor, None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), tuple(slice(start, start + size) for start, size in zip(offset, shape))


@torch.no_grad()
def read_rank_weights(
    root: torch.nn.Module,
    model: torch.nn.Module,
    checkpoint: HubCheckpoint,
    *,
    device: torch.device | None = None,
    prefix: str = "model.",
) -> list[str]:
    """Copy into ``root``'s state (the Hugging Face ``model``'s, under ``prefix``) this rank's part of each
    tensor of ``checkpoint``; returns the state's names the checkpoint lacks. With ``device``, ``root`` (on the
    meta device, but for what was made real before: a critic's fresh head, buffers) is first made real there,
    and only what was on the meta device is read."""
    kept = {}
    if device is not None:
        kept = {
            name: local_part(tensor)[0].detach().clone()
            for name, tensor in chain(root.named_parameters(), root.named_buffers())
            if not tensor.is_meta
        }
        swapping = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)  # the same Parameter objects, made real:
        try:  # tied weights stay one, and whatever holds a parameter (the pipeline, ep's list) still holds it
            root.to_empty(device=device)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swapping)
        current = dict(chain(root.named_parameters(), root.named_buffers()))
        for name, value in kept.items():
            local_part(current[name])[0].copy_(value)
    missing, done = [], set()
    for name, tensor in root.state_dict(keep_vars=True).items():
        if name in kept or id(tensor) in done:  # fresh, or a tied head already read as the embedding
            continue
        done.add(id(tensor))
        stored = stored_name(model, checkpoint, name.removeprefix(prefix))
        if stored not in checkpoint:
            missing.append(name.removeprefix(prefix))
            continue
        local, index = local_part(tensor)
        if local.numel():  # an uneven shard may hold nothing
            read_in_blocks(local, checkpoint, stored, index)
    return missing


def read_in_blocks(local: torch.Tensor, checkpoint: HubCheckpoint, name: str, index: Index | None) -> None:
    """Copy the part ``index`` (None: all) of ``checkpoint``'s tensor ``name`` into ``local``, a block of rows at a
    time: rows whose whole width (what a column slice touches in the file) holds at most ``READ_BYTES`` in
    ``local``'s dtype."""
    shape = checkpoint.shape(name)
    if not shape:
        local.copy_(checkpoint.read(name))
        return
    index = index or tuple(slice(0, size) for size in shape)
    first, rest = index[0], index[1:]
    step = max(1, READ_BYTES // (local.element_size() * math.prod(shape[1:]) or 1))
    for start in range(0, first.stop - first.start, step):
        stop = min(start + step, first.stop - first.start)
        local[start:stop].copy_(checkpoint.read(name, (slice(first.start + start, first.start + stop), *rest)))
