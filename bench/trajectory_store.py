"""Trajectory shards vs raw numpy files: write and read throughput, on-disk size, and what fsync costs.

    .venv/bin/python bench/trajectory_store.py [--trajectories 400] [--repeats 5] [--dir DIR] [--save]

Both sides store the same arrays of realistic trajectories (512-token prompt, 1k-8k output tokens,
fp32 logprobs, per-token versions and loss mask) on the same disk. The baseline appends each array to
its own flat file with ``ndarray.tofile`` and flushes at the same cadence as the shard writer (every
trajectory, or every ``--batch`` trajectories): the fastest way to put those bytes in files, with no
index, checksum or crash safety. Shards are written twice, with the two fsyncs a commit makes for a
node crash (the default) and without (``fsync=False``: safe against a killed process only); the
fsync ratio is the durable writer's throughput over the other's; it depends on the disk's fsync
latency, probed and recorded before and after the run. Shard writes include finalisation
(close, rename, manifest); reads include CRC checks and building the record objects. Repeats
alternate the three writers; medians.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import date
from pathlib import Path

import h5py
import numpy as np
from recording import machine, run_and_record

from areal_hpc.data.shards import TrajectoryShardWriter, TrajectoryStore
from areal_hpc.data.trajectory import Segment, Trajectory

ARRAYS = ("input_ids", "output_ids", "output_logprobs", "output_versions", "loss_mask")
SIDES = ("shard write", "shard write, no fsync", "raw write", "shard read", "raw read")


def realistic_trajectories(n: int, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        n_out = int(rng.integers(1024, 8193))
        versions = np.full(n_out, i // 64, dtype=np.int32)
        versions[int(rng.integers(0, n_out)) :] += 1  # one weight update mid-generation
        out.append(
            Trajectory(
                [
                    Segment(
                        rng.integers(0, 151_000, 512),
                        rng.integers(0, 151_000, n_out),
                        -rng.exponential(0.5, n_out),
                        versions,
                    )
                ],
                group_id=str(i // 8),
            )
        )
    return out


def payload_bytes(trajectories: list[Trajectory]) -> int:
    return sum(getattr(s, a).nbytes for t in trajectories for s in t.segments for a in ARRAYS)


def write_shards(folder: Path, trajectories: list[Trajectory], flush_every: int, fsync: bool) -> float:
    start = time.perf_counter()
    with TrajectoryShardWriter(folder, "bench", flush_every=flush_every, fsync=fsync) as writer:
        for traj in trajectories:
            writer.append(traj)
    return time.perf_counter() - start


def read_shards(folder: Path) -> float:
    start = time.perf_counter()
    with TrajectoryStore(folder) as store:
        n = sum(1 for _ in store.trajectories())
    assert n > 0
    return time.perf_counter() - start


def write_raw(folder: Path, trajectories: list[Trajectory], flush_every: int) -> float:
    folder.mkdir(parents=True)
    start = time.perf_counter()
    files = {a: open(folder / f"{a}.bin", "wb") for a in ARRAYS}  # noqa: SIM115 - one per array, closed after the timed writes
    lengths = []
    for i, traj in enumerate(trajectories, 1):
        seg = traj.segments[0]
        for a in ARRAYS:
            getattr(seg, a).tofile(files[a])
        lengths.append((len(seg.input_ids), len(seg.output_ids)))
        if i % flush_every == 0:
            for fh in files.values():
                fh.flush()
    np.save(folder / "lengths.npy", np.array(lengths, dtype=np.int64))
    for fh in files.values():
        fh.close()
    return time.perf_counter() - start


def read_raw(folder: Path) -> float:
    start = time.perf_counter()
    lengths = np.load(folder / "lengths.npy")
    dtypes = {
        "input_ids": np.int32,
        "output_ids": np.int32,
        "output_logprobs": np.float32,
        "output_versions": np.int32,
        "loss_mask": np.uint8,
    }
    arrays = {a: np.fromfile(folder / f"{a}.bin", dtype=dtypes[a]) for a in ARRAYS}
    cuts = {"input_ids": np.cumsum(lengths[:, 0])[:-1]}
    for a in ARRAYS[1:]:
        cuts[a] = np.cumsum(lengths[:, 1])[:-1]
    rows = list(zip(*(np.split(arrays[a], cuts[a]) for a in ARRAYS)))
    assert len(rows) == len(lengths)
    return time.perf_counter() - start


def fsync_latency_ms(folder: Path, n: int = 50) -> float:
    """Median time of a 4 KiB write + fsync on the scratch disk, what a commit's two fsyncs each cost."""
    probe, times = folder / "fsync-probe", []
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT)
    try:
        for i in range(n):
            start = time.perf_counter()
            os.pwrite(fd, os.urandom(4096), 4096 * i)
            os.fsync(fd)
            times.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        probe.unlink()
    return round(statistics.median(times) * 1e3, 3)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def run(args) -> dict:
    trajectories = realistic_trajectories(args.trajectories)
    nbytes = payload_bytes(trajectories)
    scratch = Path(tempfile.mkdtemp(prefix="areal-bench-", dir=args.dir))
    rows, latency = [], [fsync_latency_ms(scratch)]
    try:
        for label, flush_every in (("flush every trajectory", 1), (f"flush every {args.batch}", args.batch)):
            times = {name: [] for name in SIDES}
            for r in range(args.repeats):
                durable, fast, raw = (scratch / f"{side}-{flush_every}-{r}" for side in ("fsync", "nofsync", "raw"))
                times["shard write"].append(write_shards(durable, trajectories, flush_every, fsync=True))
                times["shard write, no fsync"].append(write_shards(fast, trajectories, flush_every, fsync=False))
                times["raw write"].append(write_raw(raw, trajectories, flush_every))
                times["shard read"].append(read_shards(durable))
                times["raw read"].append(read_raw(raw))
                size_ratio = folder_bytes(durable) / folder_bytes(raw)
                for folder in (durable, fast, raw):
                    shutil.rmtree(folder)
            median = {k: statistics.median(v) for k, v in times.items()}
            rows.append(
                {
                    "mode": label,
                    "flush_every": flush_every,
                    "size_ratio": round(size_ratio, 3),
                    **{f"{k} MB/s": round(nbytes / v / 1e6, 1) for k, v in median.items()},
                    **{f"{k} traj/s": round(len(trajectories) / v, 1) for k, v in median.items()},
                    "fsync ratio": round(median["shard write, no fsync"] / median["shard write"], 3),
                    "write ratio": round(median["raw write"] / median["shard write, no fsync"], 3),
                    "durable write ratio": round(median["raw write"] / median["shard write"], 3),
                    "read ratio": round(median["raw read"] / median["shard read"], 3),
                }
            )
        latency.append(fsync_latency_ms(scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "benchmark": "trajectory_store",
        "date": date.today().isoformat(),
        "machine": args.machine,
        "trajectories": len(trajectories),
        "payload_MB": round(nbytes / 1e6, 1),
        "repeats": args.repeats,
        "fsync_ms_before_after": latency,
        "versions": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version,
            "areal-hpc": _commit(),
        },
        "rows": rows,
    }


def _commit() -> str:
    """The code measured: its git commit, marked when the working tree differs from it."""
    git = ["git", "-C", str(Path(__file__).parent)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    measured = ["../areal_hpc/data/shards", "../areal_hpc/fsio.py", "."]
    dirty = subprocess.run([*git, "status", "--porcelain", "--", *measured], capture_output=True, text=True).stdout
    return (head + (" + local changes" if dirty.strip() else "")) or "unknown"


def report(result: dict) -> str:
    lines = [
        f"# Trajectory shards vs raw numpy files ({result['date']})",
        "",
        f"Machine: {result['machine']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        + ".",
        f"{result['trajectories']} trajectories, {result['payload_MB']} MB of arrays, "
        f"median of {result['repeats']} alternating repeats, scratch on the same disk for all writers; "
        "a 4 KiB write + fsync took {} ms before the run and {} ms after (medians of 50).".format(
            *result["fsync_ms_before_after"]
        ),
        "",
        "| flush policy | shard write MB/s (fsync) | shard write MB/s (no fsync) | **fsync ratio** "
        "| raw write MB/s | **write ratio** (no fsync) | write ratio (fsync) | shard read MB/s | raw read MB/s "
        "| **read ratio** | size ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['mode']} | {r['shard write MB/s']} ({r['shard write traj/s']} traj/s) | "
            f"{r['shard write, no fsync MB/s']} ({r['shard write, no fsync traj/s']} traj/s) | "
            f"**{r['fsync ratio']}x** | {r['raw write MB/s']} | **{r['write ratio']}x** | "
            f"{r['durable write ratio']}x | {r['shard read MB/s']} | {r['raw read MB/s']} | "
            f"**{r['read ratio']}x** | {r['size_ratio']} |"
        )
    lines += [
        "",
        "fsync ratio: throughput of the default writer (two fsyncs a commit: it survives a node crash) "
        "over fsync=False (it survives a killed process only). Write ratios: shard over raw writes, which "
        "never fsync. Targets (no fsync): write ratio >= 0.5x flushing every trajectory, >= 0.8x with "
        "batched flushes.",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = list(SIDES)
    width = 0.38
    for j, row in enumerate(result["rows"]):
        xs = np.arange(len(labels)) + (j - 0.5) * width
        ax.bar(xs, [row[f"{k} MB/s"] for k in labels], width, label=row["mode"])
    ax.set_xticks(np.arange(len(labels)), [label.replace(", ", "\n") for label in labels])
    ax.set_ylabel("MB/s")
    ax.set_title(f"Trajectory shards vs raw numpy files ({result['date']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="trajectories per flush in the batched mode")
    parser.add_argument("--dir", help="scratch folder (default: the system temp folder)")
    parser.add_argument("--machine", default=machine(), help="how the result names this machine")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("trajectory_store", parser.parse_args(), run, report, plot)


if __name__ == "__main__":
    main()
