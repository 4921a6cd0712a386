"""Rank 0's two handles on the training, ``TrainerRanks`` (in its own process) and ``TrainerProcess`` (in a
child), take the ``Trainer`` protocol's calls, so the loop (``driver.drive``) runs on either. mypy checks their
types (``train/trainer.py``); this checks what it cannot see: the parameters' names, kinds and defaults."""

import inspect

import pytest

from areal_hpc.train.trainer import Trainer
from areal_hpc.train.trainer_process import TrainerProcess
from areal_hpc.train.trainer_ranks import TrainerRanks

CALLS = sorted(name for name, value in vars(Trainer).items() if inspect.isfunction(value) and name[0] != "_")


def parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_names_the_loops_calls():
    assert CALLS == ["save_checkpoint", "stop", "update"]


@pytest.mark.parametrize("handle", [TrainerRanks, TrainerProcess])
def test_each_handle_takes_every_call_of_the_protocol(handle):
    for name in CALLS:
        assert parameters(getattr(handle, name)) == parameters(getattr(Trainer, name)), name
    assert isinstance(handle.trains_elsewhere, bool)
