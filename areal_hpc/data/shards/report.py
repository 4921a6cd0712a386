"""What ``areal-hpc shards inspect|verify|export`` print: a store summary, a damage check, JSONL."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import TextIO

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from areal_hpc.data.shards.format import INDEX_DTYPE, text
from areal_hpc.data.shards.reader import TrajectoryFilter, TrajectoryStore
from areal_hpc.data.trajectory import Trajectory, total_reward
from areal_hpc.errors import UserError

BAR_WIDTH = 30
MANIFEST_KEYS = ("name", "trajectories", "tokens", "rewards", "bytes", "index_crc32", "rewards_crc32")


def open_store(path: str | Path) -> TrajectoryStore:
    """The store the CLI reports on: a shard HDF5 cannot open is listed, not fatal."""
    store = TrajectoryStore(path, skip_unreadable=True)
    if not store.shards and not store.unreadable:
        store.close()
        raise UserError(f"{path} holds no trajectory shards (*.h5)")
    return store


def inspect(store: TrajectoryStore) -> str:
    """Human summary: totals, one line per shard, tenants, reward and version histograms, torn tails."""
    shards = list(store.shards.values())
    index = np.concatenate([s.index for s in shards] or [np.empty(0, dtype=INDEX_DTYPE)])
    rewards = [total_reward(store.rewards_for(text(i))) for i in index["id"]]
    scored = np.array([r for r in rewards if r is not None], dtype=np.float64)
    sizes = {s.stem: s.path.stat().st_size for s in shards}
    size = sum(sizes.values())
    n_live = sum(s.live for s in shards)
    runs = sorted({f"{s.experiment}/{s.trial}" for s in shards})
    lines = [f"{store.path}: {len(shards)} shards ({len(shards) - n_live} finalised, {n_live} live), "
             f"{len(index):,} trajectories, {int(index['token_count'].sum()):,} tokens "
             f"({int(index['n_output'].sum()):,} output), {_bytes(size)}; runs: {', '.join(runs)}", ""]
    lines.append(f"{'shard':<28} {'state':<10} {'trajectories':>12} {'tokens':>12} {'rewards':>8} {'size':>10} "
                 f"{'torn':>5}")
    for s in shards:
        lines.append(f"{s.path.name:<28} {'live' if s.live else 'finalised':<10} {len(s.index):>12,} "
                     f"{s.n_tokens:>12,} {len(s.rewards):>8,} {_bytes(sizes[s.stem]):>10} "
                     f"{s.torn_trajectories:>5}")
    tenants, counts = np.unique(index["tenant"], return_counts=True)
    lines += ["", "tenants: " + ", ".join(f"{text(t)} {c:,}" for t, c in zip(tenants, counts))]
    if len(index):
        lengths = index["n_output"]
        lines.append(f"output tokens per trajectory: min {lengths.min():,}, median {int(np.median(lengths)):,}, "
                     f"max {lengths.max():,}")
    lines += ["", f"reward ({len(scored):,} scored, {len(index) - len(scored):,} awaiting a reward):"]
    lines += _histogram(scored)
    lines += ["", "policy version of the newest output token:"]
    lines += _histogram(index["version_max"][index["version_max"] >= 0], label=lambda v: f"v{v}")
    torn = [f"{s.path.name}: {s.torn}" for s in shards if s.torn]
    lines += ["", "torn tails: " + ("; ".join(torn) or "none")]
    lines += [f"UNREADABLE: {reason}" for reason in store.unreadable.values()]
    return "\n".join(lines)


def verify(store: TrajectoryStore) -> tuple[list[str], list[str]]:
    """Check every committed record's CRC32, torn tails and the manifests. Returns (damage, notes)."""
    damage, notes = list(store.unreadable.values()), []
    shards = list(store.shards.values())
    columns = [TextColumn("verify"), BarColumn(), MofNCompleteColumn(), TextColumn("records")]
    with Progress(*columns, transient=True) as progress:
        bar = progress.add_task("verify", total=sum(len(s.index) for s in shards))
        for s in shards:
            damage += [f"{s.path.name} row {r}: checksum mismatch" for r in s.damaged_rows()]
            progress.advance(bar, len(s.index))
            if s.torn:
                damage.append(f"{s.path.name}: torn tail, {s.torn}")
            if s.live:
                notes.append(f"{s.path.name}: live (its writer is still writing, or stopped without finalising)")
    listed = set()
    for manifest_path in _manifests(store.path):
        try:
            entries = _manifest_entries(manifest_path)
        except ValueError as exc:
            damage.append(f"{manifest_path.name}: {exc}")
            continue
        for entry in entries:
            if store.path.is_file() and entry["name"] != store.path.name:
                continue
            listed.add(entry["name"])
            damage += _check_manifest_entry(store, manifest_path, entry)
    notes += [f"{s.path.name}: finalised but in no manifest (writer stopped before recording it)"
              for s in shards if not s.live and s.path.name not in listed and store.path.is_dir()]
    return damage, notes


def export_jsonl(store: TrajectoryStore, out: TextIO, where: TrajectoryFilter) -> int:
    n = 0
    for traj in store.trajectories(where):
        out.write(json.dumps(trajectory_to_json(traj)) + "\n")
        n += 1
    return n


def trajectory_to_json(traj: Trajectory) -> dict:
    return {
        "id": traj.id, "experiment": traj.experiment, "trial": traj.trial, "task": traj.task,
        "group_id": traj.group_id, "session_id": traj.session_id, "tenant": traj.tenant,
        "eligible": traj.eligible, "created": traj.created, "reward": traj.reward,
        "rewards": [{"step": r.step, "value": r.value, "source": r.source, "time": r.time} for r in traj.rewards],
        "segments": [{"input_ids": s.input_ids.tolist(), "output_ids": s.output_ids.tolist(),
                      "output_logprobs": s.output_logprobs.tolist(), "output_versions": s.output_versions.tolist(),
                      "loss_mask": s.loss_mask.tolist()} for s in traj.segments],
        "metadata": traj.metadata, "redactions": traj.redactions,
    }


def _check_manifest_entry(store: TrajectoryStore, manifest_path: Path, entry: dict) -> list[str]:
    path, name = manifest_path.parent / entry["name"], entry["name"]
    shard = next((s for s in store.shards.values() if s.path == path), None)
    if path in store.unreadable:
        return []  # already reported
    if shard is None:
        return [f"{name}: listed in {manifest_path.name} but missing"]
    found = {"trajectories": len(shard.index), "tokens": shard.n_tokens, "rewards": len(shard.rewards),
             "bytes": path.stat().st_size, "index_crc32": zlib.crc32(shard.index),
             "rewards_crc32": zlib.crc32(shard.rewards)}
    return [f"{name}: {key} is {value}, {manifest_path.name} recorded {entry[key]} (changed after finalising)"
            for key, value in found.items() if value != entry[key]]


def _manifest_entries(path: Path) -> list[dict]:
    """The shard entries of a manifest; ValueError saying what is wrong with a damaged one."""
    try:
        entries = json.loads(path.read_text())["shards"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"not a readable manifest ({type(exc).__name__}: {exc})") from None
    for entry in entries:
        missing = [key for key in MANIFEST_KEYS if not isinstance(entry, dict) or key not in entry]
        if missing:
            raise ValueError(f"an entry lacks {missing}")
    return entries


def _manifests(path: Path) -> list[Path]:
    folder = path if path.is_dir() else path.parent
    return sorted(folder.glob("manifest-*.json"))


def _histogram(values: np.ndarray, label=lambda v: f"{v:g}", bins: int = 10) -> list[str]:
    """Text bars: one per distinct value when there are few (0/1 rewards, versions), else ``bins``."""
    if len(values) == 0:
        return ["  (none)"]
    distinct, counts = np.unique(values, return_counts=True)
    if len(distinct) <= 2 * bins:
        labels = [label(v) for v in distinct]
    else:
        counts, edges = np.histogram(values, bins=bins)
        labels = [f"[{lo:.3g}, {hi:.3g})" for lo, hi in zip(edges[:-1], edges[1:])]
    width = max(len(text) for text in labels)
    top = max(counts)
    return [f"  {text:>{width}} {'#' * max(1, round(BAR_WIDTH * c / top)) if c else '':<{BAR_WIDTH}} {c:,}"
            for text, c in zip(labels, counts)]


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
