"""Damage to a live shard (a crashed writer's, never finalised) is reported as damage in bounded time.

A damaged HDF5 metadata byte made every SWMR reader hang (HDF5 re-reads metadata failing its checksum
100 times, doubling a sleep from 1 ns each time), and a live shard cut short in its record data passed
``shards inspect``. The shards here come from the real writer in a child process that is SIGKILLed once
its records are committed; sweeps run in a child process with a deadline, so a hang fails the test.
"""

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from areal_hpc.cli import main
from areal_hpc.data.shards import ShardDamageError, TrajectoryConsumer, TrajectoryShardWriter, TrajectoryStore
from areal_hpc.data.shards.format import COLUMNS, COUNTED, METADATA_WAIT, read_attempts
from areal_hpc.data.shards.report import export_jsonl, open_store, verify
from areal_hpc.data.trajectory import Segment, Trajectory
from tests.conftest import REPO, run_cli
from tests.shard_processes import make_trajectory

SHARD = "w0-000000.live.h5"
DEADLINE = 30  # seconds: what any command may take on a damaged shard
SWEEP_WAIT = 0.001  # the sweeps' metadata_wait: a damaged byte costs each reader ~1 ms, not ~1 s


def trajectory(i: int, output_tokens: int) -> Trajectory:
    """Record i: the crash tests' seeded record, or one segment of ``output_tokens`` tokens."""
    if not output_tokens:
        traj = make_trajectory(50, i)
        traj.id = f"t{i}"
        return traj
    rng = np.random.default_rng(i)
    return Trajectory(
        [
            Segment(
                rng.integers(0, 50_000, 8),
                rng.integers(0, 50_000, output_tokens),
                -rng.exponential(1.0, output_tokens),
                np.zeros(output_tokens, int),
                np.ones(output_tokens, int),
            )
        ],
        id=f"t{i}",
    )


def write_then_hang(directory: str, count: int, output_tokens: int, sleep: float) -> None:
    """The child writer: commit ``count`` records (one line each), then stay open until killed."""
    writer = TrajectoryShardWriter(directory, "w0", experiment="damage", trial="t0", max_shard_trajectories=count + 1)
    for i in range(count):
        writer.append(trajectory(i, output_tokens))
        print(f"committed t{i}", flush=True)
        time.sleep(sleep)
    time.sleep(600)


def start_writer(folder: Path, count: int, output_tokens: int = 0, sleep: float = 0.0) -> subprocess.Popen:
    code = (
        f"from tests.data.test_shard_damage import write_then_hang; write_then_hang({str(folder)!r}, {count}, "
        f"{output_tokens}, {sleep})"
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)


def crashed_writer(folder: Path, count: int, output_tokens: int = 0) -> Path:
    """The live shard of a writer SIGKILLed after committing ``count`` records."""
    writer = start_writer(folder, count, output_tokens)
    try:
        for _ in range(count):
            assert writer.stdout.readline().startswith("committed")
    finally:
        writer.kill()
        writer.wait(timeout=30)
        writer.stdout.close()
    return folder / SHARD


def raw_data(path: Path) -> list[tuple[int, int]]:
    """[start, end) file ranges of every dataset's stored data; the rest of the file is HDF5 metadata."""
    ranges = []
    with h5py.File(path, "r", swmr=True) as f:
        for dataset in f.values():
            if dataset.chunks is None:
                ranges.append((dataset.id.get_offset(), dataset.id.get_offset() + dataset.id.get_storage_size()))
            for i in range(dataset.id.get_num_chunks() if dataset.chunks else 0):
                chunk = dataset.id.get_chunk_info(i)
                ranges.append((chunk.byte_offset, chunk.byte_offset + chunk.size))
    return ranges


def metadata_offsets(path: Path, step: int) -> list[int]:
    ranges = raw_data(path)
    return [o for o in range(0, path.stat().st_size, step) if not any(a <= o < b for a, b in ranges)]


def committed_end(path: Path) -> int:
    """Where in the file the last committed byte of any dataset lies (chunks are allocated in file order)."""
    ends = []
    with h5py.File(path, "r", swmr=True) as f:
        state = f["state"][:]
        for name, column in COLUMNS.items():
            size = int(state[COUNTED.index(column.counter)]) * column.dtype.itemsize
            if size:
                dataset = f[name]
                last = (size - 1) // dataset.chunks[0] * dataset.chunks[0]
                ends.append(dataset.id.get_chunk_info_by_coord((last,)).byte_offset + size - last)
    return max(ends)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        value = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([value ^ 0xFF]))


def verdicts(folder: Path, metadata_wait: float) -> dict[str, str | list[str]]:
    """What verify, inspect, export and a consumer make of ``folder``: "damage", or the ids read."""
    out: dict[str, str | list[str]] = {}
    damage, _, _ = verify(folder, metadata_wait)
    out["verify"] = "damage" if damage else "ok"
    with open_store(folder, metadata_wait) as store:
        out["inspect"] = out["export"] = "damage" if store.problems() else "ok"  # export refuses what inspect flags
        if not store.problems():
            exported = io.StringIO()
            try:
                export_jsonl(store, exported, where=None)
                out["export"] = [json.loads(line)["id"] for line in exported.getvalue().splitlines()]
            except ShardDamageError:
                out["export"] = "damage"
    try:
        with TrajectoryStore(folder, metadata_wait=metadata_wait) as store:
            out["consumer"] = [t.id for t in TrajectoryConsumer(store).poll(10_000)]
    except ShardDamageError:
        out["consumer"] = "damage"
    return out


def sweep(pristine: str, folder: str, damages: str) -> None:
    """The child of the sweeps: for each damage (("flip", offset) or ("truncate", size)) applied to a
    copy of ``pristine``, one JSON line: the damage, the verdicts, the seconds they took."""
    pristine, folder = Path(pristine), Path(folder)
    for kind, where in json.loads(damages):
        shutil.copy(pristine, folder / SHARD)
        if kind == "flip":
            flip(folder / SHARD, where)
        else:
            os.truncate(folder / SHARD, where)
        start = time.monotonic()
        found = verdicts(folder, SWEEP_WAIT)
        print(json.dumps([kind, where, found, time.monotonic() - start]), flush=True)


def run_sweep(pristine: Path, folder: Path, damages: list[tuple[str, int]], deadline: float) -> list:
    folder.mkdir()
    code = (
        "from tests.data.test_shard_damage import sweep; "
        f"sweep({str(pristine)!r}, {str(folder)!r}, {json.dumps(damages)!r})"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=deadline)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def assert_agree(results: list, committed: list[str]) -> int:
    """Every reader agrees on each damage: all "damage", or all read every committed record. Returns
    how many were damage."""
    damaged = 0
    for kind, where, found, seconds in results:
        assert seconds < 5, (kind, where, seconds)
        if found["verify"] == "damage":
            assert found == dict.fromkeys(found, "damage"), (kind, where, found)
            damaged += 1
        else:
            assert found == {"verify": "ok", "inspect": "ok", "export": committed, "consumer": committed}, (
                kind,
                where,
                found,
            )
    return damaged


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    return crashed_writer(tmp_path_factory.mktemp("crashed"), count=6)


@pytest.fixture(scope="module")
def crashed_big(tmp_path_factory) -> Path:
    """Records of 6,000 tokens: the token chunks after the first lie beyond the index and reward
    chunks, so cutting the file short there leaves every index row intact."""
    return crashed_writer(tmp_path_factory.mktemp("crashed_big"), count=8, output_tokens=6000)


def test_a_swmr_reader_waits_about_metadata_wait_for_a_checksum_then_gives_up():
    assert read_attempts(0) == 1
    for wait in (SWEEP_WAIT, METADATA_WAIT, 30.0):
        slept = (2 ** read_attempts(wait) - 1) * 1e-9  # HDF5 sleeps 1, 2, 4... ns after each failed read
        assert wait <= slept < 2 * wait + 1e-9
    with pytest.raises(ValueError, match="metadata_wait must be >= 0 seconds, got -1"):
        read_attempts(-1)


def test_the_metadata_wait_option_says_its_default_and_refuses_nonsense(capsys):
    for action in ("inspect", "verify", "export"):
        with pytest.raises(SystemExit):
            main(["shards", action, "--help"])
        assert f"(default: {METADATA_WAIT:g} s)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as exit_code:
        main(["shards", "verify", "--metadata-wait", "-1", "."])
    assert exit_code.value.code == 2
    assert "--metadata-wait: '-1' is not a number of seconds >= 0" in capsys.readouterr().err


@pytest.mark.slow
def test_every_damaged_metadata_byte_is_damage_to_every_reader_or_changes_nothing(crashed, tmp_path):
    # every 7th byte outside the stored data: superblock, object headers, chunk indexes, attributes
    offsets = metadata_offsets(crashed, step=7)
    assert len(offsets) > 400
    results = run_sweep(crashed, tmp_path / "flipped", [("flip", o) for o in offsets], deadline=50)
    assert len(results) == len(offsets)
    damaged = assert_agree(results, [f"t{i}" for i in range(6)])
    assert damaged > 0.7 * len(offsets)  # the rest is unused space: nothing reads it


@pytest.mark.slow
def test_a_live_shard_cut_short_anywhere_is_damage_to_every_reader(crashed_big, tmp_path):
    size = crashed_big.stat().st_size
    sizes = sorted({*range(0, size, size // 40), size - 1, size})
    results = run_sweep(crashed_big, tmp_path / "cut", [("truncate", s) for s in sizes], deadline=50)
    committed = [f"t{i}" for i in range(8)]
    assert_agree(results, committed)
    end = committed_end(crashed_big)
    assert all(found["verify"] == "damage" for _, cut, found, _ in results if cut < end)
    assert results[-1][2]["consumer"] == committed  # the whole file: nothing lost


def cli_and_consumer(folder: Path) -> list[tuple[str, int, str, str, float]]:
    """(what, exit code, stdout, stderr, seconds) of verify, inspect and export through the real CLI,
    and of a consumer taking records in a child process, each with the default metadata wait."""
    out = []
    consume = (
        "import sys; from areal_hpc.data.shards import TrajectoryConsumer, TrajectoryStore\n"
        "try:\n    TrajectoryConsumer(TrajectoryStore(sys.argv[1])).take(100, timeout=1)\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc, file=sys.stderr); sys.exit(1)"
    )
    for action in ("verify", "inspect", "export"):
        start = time.monotonic()
        result = run_cli("shards", action, str(folder), timeout=DEADLINE)
        out.append((action, result.returncode, result.stdout, result.stderr, time.monotonic() - start))
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", consume, str(folder)], cwd=REPO, capture_output=True, text=True, timeout=DEADLINE
    )
    out.append(("consumer", result.returncode, result.stdout, result.stderr, time.monotonic() - start))
    return out


def assert_damage_reported(folder: Path, damage: str) -> None:
    """verify, inspect and export exit 1 within the deadline, naming the shard and the damage in one
    line (verify: on stdout, the others: on stderr); the consumer raises ShardDamageError saying so."""
    path = folder / SHARD
    for action, code, stdout, stderr, seconds in cli_and_consumer(folder):
        assert seconds < DEADLINE, (action, seconds)
        assert code == 1, (action, stdout, stderr)
        if action == "verify":
            line = next(line for line in stdout.splitlines() if line.startswith("DAMAGE"))
            assert line.startswith(f"DAMAGE: {path}: ") and stdout.endswith(
                "damage found, 0 committed records checked\n"
            ), stdout
        elif action == "consumer":
            line = stderr
            assert line.startswith(f"ShardDamageError {path}: "), stderr
        else:
            line = stderr
            assert stderr.count("\n") == 1 and stdout == "", (action, stdout, stderr)
            assert f"1 unreadable or damaged: {path}: " in stderr, (action, stderr)
        assert damage in line, (action, line)


def object_header(path: Path, name: str) -> int:
    with h5py.File(path, "r", swmr=True) as f:
        return h5py.h5o.get_info((f[name] if name else f).id).addr


@pytest.mark.slow
@pytest.mark.parametrize("where", ["superblock status flags", "root group header", "index dataset header"])
def test_a_damaged_metadata_byte_of_a_crashed_writers_shard_fails_every_command_in_bounded_time(
    crashed, tmp_path, where
):
    offset = {
        "superblock status flags": lambda: 11,
        "root group header": lambda: object_header(crashed, "") + 8,
        "index dataset header": lambda: object_header(crashed, "index") + 8,
    }[where]()
    folder = tmp_path / "flipped"
    folder.mkdir()
    shutil.copy(crashed, folder / SHARD)
    flip(folder / SHARD, offset)
    assert_damage_reported(folder, "incorrect metadata checksum after all read attempts")


@pytest.mark.slow
def test_a_crashed_writers_shard_cut_short_in_its_records_fails_every_command(crashed_big, tmp_path):
    ranges = sorted(raw_data(crashed_big))
    last_chunk_start = ranges[-1][0]  # token data only: every index row is still in the file
    folder = tmp_path / "cut"
    folder.mkdir()
    shutil.copy(crashed_big, folder / SHARD)
    os.truncate(folder / SHARD, last_chunk_start + 100)
    assert_damage_reported(folder, "truncated: committed tokens data lies past the end of the file")


@pytest.mark.slow
def test_tailing_a_live_shard_while_its_writer_crosses_chunks_never_reports_damage(tmp_path):
    # records of 3,000 tokens: a new token chunk every ~5 commits, read while the writer allocates it
    count = 60
    writer = start_writer(tmp_path, count, output_tokens=3000, sleep=0.005)
    try:
        assert writer.stdout.readline().startswith("committed")
        got = []
        with TrajectoryStore(tmp_path) as store:
            consumer = TrajectoryConsumer(store)
            deadline = time.monotonic() + 60
            while len(got) < count and time.monotonic() < deadline:
                got += [t.id for t in consumer.take(count - len(got), timeout=0.05, poll_interval=0.001)]
    finally:
        writer.kill()
        writer.wait(timeout=30)
        writer.stdout.close()
    assert got == [f"t{i}" for i in range(count)]
