"""Activation recomputation for the PyTorch-native engine (``actor.recompute``): "full" keeps only each
decoder layer's input and reruns the layer in the backward pass, "selective" does so for each layer's
attention sub-module (``self_attn``: projections, rotary embedding and attention) only.

Applied to the plain model before any parallelism, by torch's composable non-reentrant ``checkpoint``
(forward hooks: parameter names stay the model's, and ``fully_shard`` then wraps the layers as before).
The rerun happens in the backward pass, after ``packed_attention`` has given the model its own
attention implementation back; each checkpoint re-enters the implementation its forward ran with.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.distributed._composable import checkpoint

from areal_hpc.models.varlen import packed_attention

RECOMPUTED_MODULES = {"none": (), "selective": ("self_attn",), "full": ("",)}  # per decoder layer


def recompute_activations(model: torch.nn.Module, recompute: str) -> None:
    """Checkpoint each decoder layer of ``model`` ("full"), its attention ("selective"), or nothing ("none")."""

    def same_attention():
        """(forward context, recompute context): the rerun attends as the forward did."""
        return nullcontext(), packed_attention(model, model.config._attn_implementation)

    for layer in model.base_model.layers:
        for name in RECOMPUTED_MODULES[recompute]:
            checkpoint(layer.get_submodule(name), context_fn=same_attention)
