"""What ``shards inspect|verify|export`` say about unreadable shards, torn tails and big folders."""

import os
import re
import subprocess
import sys

import h5py
import numpy as np

from areal_hpc.data.shards import TrajectoryShardWriter
from areal_hpc.data.trajectory import Segment, Trajectory
from tests.conftest import REPO, run_cli
from tests.data.test_shard_checksums import crashed_writer_folder
from tests.shard_processes import make_trajectory


def write(folder, records, **options):
    with TrajectoryShardWriter(folder, "w0", **options) as writer:
        for traj in records:
            writer.append(traj)


def truncate_to_half(path):
    os.truncate(path, path.stat().st_size // 2)


def set_state(path, position: int, delta: int) -> None:
    """Change one of the eight commit counts in place, as raw bytes (``state`` is contiguous)."""
    with h5py.File(path, "r", swmr=path.name.endswith(".live.h5")) as f:
        offset, value = f["state"].id.get_offset() + 8 * position, int(f["state"][position])
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(np.int64(value + delta).tobytes())


def test_unreadable_shards_fail_export_and_inspect_in_one_line(tmp_path):
    only = tmp_path / "only"
    write(only, [make_trajectory(30, i) for i in range(4)])
    truncate_to_half(only / "w0-000000.h5")
    out = tmp_path / "out.jsonl"
    for args in (("export", str(only), "--output", str(out)), ("export", str(only)), ("inspect", str(only))):
        result = run_cli("shards", *args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert result.stderr.count("\n") == 1 and f"{only / 'w0-000000.h5'}: HDF5 cannot open it" in result.stderr
        assert result.stdout == ""
    assert not out.exists() and not list(tmp_path.glob("*.partial"))

    mixed = tmp_path / "mixed"  # one readable shard, one not: inspect summarises the first, both fail
    write(mixed, [make_trajectory(31, i) for i in range(4)], max_shard_trajectories=2)
    truncate_to_half(mixed / "w0-000001.h5")
    inspect = run_cli("shards", "inspect", str(mixed))
    assert inspect.returncode == 1 and "1 shards (1 finalised, 0 live), 2 trajectories" in inspect.stdout
    assert "1 unreadable or damaged: " in inspect.stderr and "w0-000001.h5: HDF5 cannot open it" in inspect.stderr
    export = run_cli("shards", "export", str(mixed), "--output", str(out))
    assert export.returncode == 1 and "w0-000001.h5" in export.stderr and not out.exists()


def test_a_dead_writers_torn_tail_is_a_note_and_damage_to_committed_counts_is_not(tmp_path):
    crashed = crashed_writer_folder(tmp_path / "crashed", count=3)
    set_state(crashed, 4, +1)  # intended > committed: what a writer killed mid-commit leaves
    set_state(crashed, 7, +1)
    result = run_cli("shards", "verify", str(crashed.parent))
    assert result.returncode == 0, result.stdout
    assert (
        "note: w0-000000.live.h5: torn tail, an interrupted commit of 1 trajectories and 1 rewards (ignored): "
        "its writer stopped mid-commit (or is committing right now); nothing committed is lost"
    ) in result.stdout

    finalised = tmp_path / "finalised"
    write(finalised, [make_trajectory(32, i) for i in range(3)])
    set_state(finalised / "w0-000000.h5", 4, +1)  # a finalised shard never holds an unfinished commit
    result = run_cli("shards", "verify", str(finalised))
    assert result.returncode == 1
    assert (
        "DAMAGE: w0-000000.h5: finalised, yet it holds an unfinished commit (an interrupted commit of 1 "
        "trajectories and 0 rewards (ignored))"
    ) in result.stdout

    impossible = crashed_writer_folder(tmp_path / "impossible", count=3)
    set_state(impossible, 4, -1)  # fewer intended than committed: no commit ever writes that
    result = run_cli("shards", "verify", str(impossible.parent))
    assert result.returncode == 1
    assert (
        "DAMAGE: w0-000000.live.h5: commit counts impossible (more index committed than ever intended)" in result.stdout
    )


def peak_rss_of_verify(folder) -> tuple[int, str]:
    script = (
        "import resource, sys; from areal_hpc.cli import main; rc = main(['shards', 'verify', sys.argv[1]]); "
        "print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(folder)], cwd=REPO, capture_output=True, text=True, check=True
    )
    _, kilobytes, rc = result.stdout.splitlines()[-1].split()
    return int(kilobytes), rc


def test_verify_memory_does_not_grow_with_the_number_of_shards(tmp_path):
    # HDF5 keeps ~0.5 MB per open file: verify must hold one shard at a time (it held all of them)
    tiny = [Trajectory([Segment([1, 2], [3], [-0.5], [0])], id=f"t{i}") for i in range(300)]
    write(tmp_path / "few", tiny[:30], max_shard_trajectories=1, fsync=False)
    write(tmp_path / "many", tiny, max_shard_trajectories=1, fsync=False)
    few, rc_few = peak_rss_of_verify(tmp_path / "few")
    many, rc_many = peak_rss_of_verify(tmp_path / "many")
    assert rc_few == rc_many == "0"
    assert many - few < 30_000, (few, many)  # 270 more shards: 140 MB more when all were kept open


def test_verify_shows_progress_on_a_terminal_and_keeps_stdout_for_the_report(tmp_path):
    write(tmp_path, [make_trajectory(33, i) for i in range(4)], max_shard_trajectories=2)
    result = subprocess.run(
        [sys.executable, "-m", "areal_hpc", "shards", "verify", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "FORCE_COLOR": "1"},
    )
    assert result.returncode == 0
    assert "2/2 shards, 4 records" in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", result.stderr)  # rich's bar, on stderr
    assert result.stdout == f"{tmp_path}: ok, 4 committed records checked\n"
