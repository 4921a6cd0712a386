"""Durability against a node crash, not only a killed process: what is fsynced, and before which step.

A crashed node loses whatever the kernel had not written; only the order of fsyncs and renames
decides what survives. These tests record that order (every fsync with the path it made durable,
every rename, every write of a shard's commit counts) for shard commits and for checkpoints.
"""

import os
import re
from pathlib import Path

import numpy as np
import pytest

from areal_hpc.data.shards import TrajectoryShardWriter, TrajectoryStore
from areal_hpc.data.shards import writer as writer_module
from areal_hpc.runtime.run_state import latest_checkpoint
from areal_hpc.train.checkpoint import save_checkpoint
from tests.shard_processes import make_trajectory


@pytest.fixture
def disk_log(monkeypatch) -> list[tuple]:
    """("fsync", path, inode), ("rename", src, dst), ("write", dataset, values) in the order they happen
    (a shard is written through a handle opened under its staging name, hence the inode)."""
    events, real = [], {name: getattr(os, name) for name in ("fsync", "replace", "rename")}

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_ino))
        real["fsync"](fd)

    def renamer(name):
        def rename(src, dst, *args, **kwargs):
            events.append(("rename", str(src), str(dst)))
            real[name](src, dst, *args, **kwargs)

        return rename

    real_write = writer_module._Column.write

    def write(column, start, values):
        events.append(("write", column.dataset.name, np.array(values)))
        real_write(column, start, values)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", renamer("replace"))
    monkeypatch.setattr(os, "rename", renamer("rename"))
    monkeypatch.setattr(writer_module._Column, "write", write)
    return events


def synced(events: list[tuple]) -> set:
    """The paths and inodes these events fsynced."""
    return {e[1] for e in events if e[0] == "fsync"} | {e[2] for e in events if e[0] == "fsync"}


def commit_steps(events: list[tuple], shard: Path) -> str:
    """One letter per step of the writer's commits: I intended counts, D data, C committed counts
    (a state write whose two halves agree), F fsync of the shard."""
    steps = ""
    for event in events:
        if event[0] == "write":
            state = event[2]
            steps += ("C" if (state[:4] == state[4:]).all() else "I") if event[1] == "/state" else "D"
        elif event[0] == "fsync" and event[2] == shard.stat().st_ino:
            steps += "F"
    return steps


@pytest.mark.parametrize("fsync", [True, False])
def test_each_commit_is_on_disk_before_its_counts_and_before_flush_returns(tmp_path, disk_log, fsync):
    writer = TrajectoryShardWriter(tmp_path, "w0", fsync=fsync)
    for i in range(3):
        writer.append(make_trajectory(50, i))
        steps = commit_steps(disk_log, tmp_path / "w0-000000.live.h5")
        assert re.fullmatch("(ID+FCF)+" if fsync else "(ID+C)+", steps.lstrip("F")), steps  # F: its creation
        assert steps.endswith("FCF" if fsync else "C")  # append returned: the commit is durable
    writer.close()


def test_a_finalised_shard_is_on_disk_before_its_rename_and_listed_after(tmp_path, disk_log):
    with TrajectoryShardWriter(tmp_path, "w0") as writer:
        writer.append(make_trajectory(51, 0))
    live, final, manifest = (str(tmp_path / name) for name in ("w0-000000.live.h5", "w0-000000.h5", "manifest-w0.json"))
    renamed = disk_log.index(("rename", live, final))
    assert live in synced(disk_log[:renamed])  # what closing the file wrote is on disk first
    listed = next(i for i, e in enumerate(disk_log) if e[0] == "rename" and e[2] == manifest)
    assert disk_log[listed][1] in synced(disk_log[renamed:listed])  # the manifest's data, then its name
    assert str(tmp_path) in synced(disk_log[listed:])  # the folder: both renames are durable
    with TrajectoryStore(tmp_path) as store:
        assert len(store) == 1


class FakeEngine:
    def save(self, folder: Path) -> None:
        (folder / "optimizer").mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
        (folder / "optimizer" / "state.pt").write_bytes(b"moments")


def test_a_checkpoint_is_on_disk_before_its_name_and_before_latest_names_it(tmp_path, disk_log):
    pytest.importorskip("torch")
    final = save_checkpoint(tmp_path, 4, {"actor": FakeEngine(), "critic": FakeEngine()}, {"cursor": {}})
    staging = final.with_name(final.name + ".partial")
    renamed = disk_log.index(("rename", str(staging), str(final)))
    before = synced(disk_log[:renamed])
    files = list(final.rglob("*"))
    assert len(files) == 10  # 2 x (engine/, model, optimizer/, optimizer/state.pt), rng.pt, driver.json
    for path in files + [final]:
        assert str(staging / path.relative_to(final)) in before, path  # every file and folder, under its staging name
    root = str(tmp_path / "checkpoints")
    pointed = next(i for i, e in enumerate(disk_log) if e[0] == "rename" and e[2] == f"{root}/latest")
    assert root in synced(disk_log[renamed:pointed])  # the checkpoint's name is durable before latest names it
    assert disk_log[pointed][1] in synced(disk_log[renamed:pointed])
    assert root in synced(disk_log[pointed:])
    assert latest_checkpoint(tmp_path) == final


def test_a_failed_commit_drops_its_records_and_the_next_commit_writes_over_it(tmp_path, monkeypatch):
    """A full disk in the middle of a commit: the caller is told the group was not stored, so it must
    never surface later (the controller counted it as failed and will not train it); the next commit
    starts at the last committed counts and the folder verifies clean."""
    from areal_hpc.data.shards import UnknownTrajectoryError
    from areal_hpc.data.shards.report import verify

    real_write, calls = writer_module._Column.write, {"n": 0, "fail_at": None}

    def write(column, start, values):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise OSError(28, "No space left on device")
        real_write(column, start, values)

    monkeypatch.setattr(writer_module._Column, "write", write)
    writer = TrajectoryShardWriter(tmp_path, "w0", flush_every=100)
    stored = [make_trajectory(5, i) for i in range(2)]
    for trajectory in stored:
        writer.append(trajectory)
    writer.flush()
    lost = make_trajectory(5, 2)
    writer.append(lost)
    calls["fail_at"] = calls["n"] + 3  # intended counts and the tokens are written, then the disk is full
    with pytest.raises(OSError, match="No space left"):
        writer.flush()
    with pytest.raises(UnknownTrajectoryError):
        writer.set_reward(lost.id, 1.0)
    after = make_trajectory(5, 3)
    writer.append(after)
    writer.flush()
    writer.append(lost)  # a retry of the lost group is a new append, accepted once
    writer.close()
    store = TrajectoryStore(tmp_path)
    assert [t.id for t in store.trajectories()] == [t.id for t in [*stored, after, lost]]
    store.close()
    damage, _notes, checked = verify(tmp_path)
    assert (damage, checked) == ([], 4)
