"""What trainer rank 0's loop (``driver.drive``, ``rl_run.RLRun``) asks of the training: the ``Trainer`` protocol.
Two handles implement it: ``trainer_ranks.TrainerRanks`` (the training in rank 0's own process, every rank
following its calls) and ``trainer_process.TrainerProcess`` (the same calls sent to a child process that is
trainer rank 0); the loop cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from areal_hpc.data.trajectory import Trajectory


class StandInEngine(Protocol):
    """Rank 0's stand-in for an engine (``LeaderEngine``, ``RemoteEngine``), what the loop uses of it: its
    tokenizer and device, and saving its weights."""

    @property
    def tokenizer(self) -> Any: ...  # a Hugging Face tokenizer (untyped)

    @property
    def device(self) -> torch.device: ...

    def save(self, folder: Path, *, optimizer: bool = True) -> None: ...


@runtime_checkable
class Trainer(Protocol):
    """Rank 0's handle on the training: ``update`` trains every rank on a batch, ``save_checkpoint`` saves the
    run, ``stop`` releases the ranks; ``engines`` by name ("actor", "critic", ...)."""

    @property
    def trains_elsewhere(self) -> bool: ...  # the training runs in another process (on this one's cores)

    @property
    def engines(self) -> Mapping[str, StandInEngine]: ...

    def update(
        self, trajectories: list[Trajectory], teacher_logprobs: list[list[float]] | None = None
    ) -> dict[str, float]:
        """Proximal logprobs and the PPO steps of one batch on every rank (``teacher_logprobs``: a distillation
        teacher's scores of it); the summed statistics."""
        ...

    def save_checkpoint(self, run_dir: Path, step: int, driver: dict[str, Any]) -> Path:
        """A checkpoint of every engine, the training's RNG streams and the loop's JSON-able ``driver`` state."""
        ...

    def stop(self) -> None:
        """Release the other ranks (and the training process); the handle is done."""
        ...


if TYPE_CHECKING:  # mypy holds rank 0's two handles to the protocol
    from areal_hpc.train.trainer_process import TrainerProcess
    from areal_hpc.train.trainer_ranks import TrainerRanks

    HANDLES: tuple[type[Trainer], ...] = (TrainerRanks, TrainerProcess)
