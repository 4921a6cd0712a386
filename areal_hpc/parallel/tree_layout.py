"""``actor.tree_training=auto``: tree training (AReaL-DTA) wherever the run's layout and options allow it,
flat training elsewhere. Arithmetic on the config, so the launcher resolves it before its checks, as the
trainer does before it builds the actor; the engine's class (``supports_tree_training``) is loaded only when
everything else allows a tree."""

from __future__ import annotations

from areal_hpc import builtins
from areal_hpc.errors import UserError
from areal_hpc.parallel.dims import ParallelDims


def resolve_tree_training(cfg):
    """``cfg``, changed in place: ``actor.tree_training=auto`` becomes dta where tree training runs (what
    ``build_actor`` and the engines accept for it: an engine that trains trees (the torch engine), a
    token-level loss, no LoRA, no
    recomputation, one process or data-parallel replicas of one shape), else off; other values stay."""
    actor = cfg.actor
    if actor.tree_training != "auto":
        return cfg
    try:
        dims = ParallelDims.from_config(actor.parallel, cfg.rl.trainer_processes)
    except UserError:  # said where the layout is used; it trains no tree either way
        dims = None
    fits = (
        dims is not None
        and dims.world_size == dims.dp
        and dims.ep == 1
        and not actor.parallel.groups
        and actor.importance_level == "token"
        and not actor.lora.rank
        and actor.recompute == "none"
        and builtins.load("train_engine", actor.engine).supports_tree_training
    )
    actor.tree_training = "dta" if fits else "off"
    return cfg
