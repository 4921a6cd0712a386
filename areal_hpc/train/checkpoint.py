"""Checkpoints of an RL run: everything needed to continue exactly, written atomically.

    <run>/checkpoints/step000040/{actor/, critic/, rng.pt, driver.json}
    <run>/checkpoints/latest            -> "step000040"

``driver.json`` holds the policy version (= completed steps), the prompt-stream position and the
trajectory-shard consumer cursor. The folder is written under a ``.partial`` name, fsynced, renamed,
then ``latest`` is replaced (fsynced too): a run killed at any moment, or on a node that crashes,
resumes from the last complete checkpoint, and the cursor in that same checkpoint decides which
stored trajectories are still to be trained.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np

from areal_hpc.fsio import atomic_write_json, atomic_write_text, fsync_path, fsync_tree
from areal_hpc.runtime.run_state import checkpoint_root

KEEP = 2


def save_checkpoint(run_dir: Path, step: int, engines: dict, driver: dict) -> Path:
    """``engines``: name -> engine with ``save(folder)`` (actor, critic); ``driver``: JSON-able state."""
    import torch  # here, not at the top: the launcher looks for checkpoints without loading torch

    root = checkpoint_root(run_dir)
    final = root / f"step{step:06d}"
    staging = final.with_name(final.name + ".partial")
    for leftover in root.glob("step*.partial"):  # a save cut short by a kill
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir(parents=True)
    for name, engine in engines.items():
        engine.save(staging / name)
    torch.save(
        {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        staging / "rng.pt",
    )
    atomic_write_json(staging / "driver.json", {"step": step, **driver})
    fsync_tree(staging)  # the engines' files are on disk before any name points at them
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    fsync_path(root)
    fsync_path(run_dir)  # holds ``checkpoints/`` since the first save
    atomic_write_text(root / "latest", final.name + "\n")
    for old in sorted(p for p in root.glob("step*") if p.is_dir() and not p.name.endswith(".partial"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(folder: Path, engines: dict) -> dict:
    """Load engines and RNG states; returns the driver state."""
    import torch

    for name, engine in engines.items():
        engine.load(folder / name)
    rng = torch.load(folder / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    return json.loads((folder / "driver.json").read_text())
