"""The one way to a training engine: ``build_engine(role, cfg, mesh)`` resolves ``actor.engine`` (a built-in's
name or the user's ``'file.py:Class'`` / ``'pkg.mod:Class'``, through ``builtins``) and calls its class's
``build``. The RL trainer (policy, reference, critic), SFT, DPO and the reward model build theirs here, so an
engine is its folder, one row in ``builtins.POINTS["train_engine"]`` and its tests; the roles and what each
reads of the config are ``engines.base``'s (``ROLES``, ``role_training``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_hpc import builtins
from areal_hpc.config import RunConfig
from areal_hpc.engines.base import TrainEngine
from areal_hpc.errors import UserError
from areal_hpc.parallel.mesh import TrainMesh


def engine_class(engine: str) -> type[TrainEngine]:
    """The ``TrainEngine`` class ``actor.engine`` names (its capabilities are class attributes)."""
    cls = builtins.load("train_engine", engine)
    if not isinstance(cls, type) or TrainEngine not in cls.__mro__:
        raise UserError(
            f"config key 'actor.engine': {engine!r} is not a subclass of "
            f"areal_hpc.engines.base.TrainEngine (e.g. of the torch engine's TorchTrainEngine)"
        )
    return cls


def build_engine(role: str, cfg: RunConfig, mesh: TrainMesh | None, path: str | Path, tokenizer: Any) -> TrainEngine:
    """The engine of ``role`` (one of ``engines.base.ROLES``) for the run ``cfg`` (a ``RunConfig``):
    ``actor.engine``'s class's ``build``, from the Hugging Face folder ``path``, saving ``tokenizer`` with
    its weights, on ``mesh`` (None: one process on ``cluster.device``)."""
    engine: TrainEngine = engine_class(cfg.actor.engine).build(role, cfg, mesh, Path(path), tokenizer)
    return engine
