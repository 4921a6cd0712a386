"""What ``areal-hpc shards inspect|verify|export`` print: a store summary, a damage check, JSONL, or the
records as text decoded by the run's tokenizer (each turn with its role and what of it is trained).

``verify`` reads one shard at a time (its memory is that of the largest shard, whatever the folder
holds) and tells damage to committed data (exit 1) from what a crash leaves by design: a live shard
nobody finalised, a torn tail of a commit its writer never finished (notes, exit 0).
"""

from __future__ import annotations

import itertools
import json
import re
import zlib
from pathlib import Path
from typing import TextIO

import numpy as np
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from areal_hpc.data.shards.format import COUNTED, INDEX_DTYPE, METADATA_WAIT, ShardDamageError, text
from areal_hpc.data.shards.reader import ShardFile, TrajectoryFilter, TrajectoryStore, open_listed, shard_paths
from areal_hpc.data.trajectory import Trajectory, total_reward
from areal_hpc.errors import UserError

BAR_WIDTH = 30
MANIFEST_KEYS = ("name", "trajectories", "tokens", "rewards", "bytes", "index_crc32", "rewards_crc32")


def open_store(path: str | Path, metadata_wait: float = METADATA_WAIT) -> TrajectoryStore:
    """The store the CLI reports on: a shard HDF5 cannot open is listed (``problems()``), not fatal."""
    store = TrajectoryStore(path, skip_unreadable=True, metadata_wait=metadata_wait)
    if not store.shards and not store.unreadable:
        store.close()
        raise UserError(f"{path} holds no trajectory shards (*.h5)")
    return store


def problems_line(store: TrajectoryStore, shown: int = 3) -> str:
    """``store.problems()`` as one line: the first few, how many more, what to run."""
    found = store.problems()
    more = f"; and {len(found) - shown} more" if len(found) > shown else ""
    return (
        f"{store.path}: {len(found)} unreadable or damaged: {'; '.join(found[:shown])}{more} "
        f"(run 'areal-hpc shards verify {store.path}')"
    )


def inspect(store: TrajectoryStore) -> str:
    """Human summary: totals, one line per shard, tenants, reward and version histograms, torn tails.
    Rows failing their checksum are counted per shard but left out of the totals and histograms."""
    shards = list(store.shards.values())
    index = np.concatenate([s.index[s.index_intact] for s in shards] or [np.empty(0, dtype=INDEX_DTYPE)])
    try:
        rewards = [total_reward(store.rewards_for(text(i))) for i in index["id"]]
    except ShardDamageError:
        rewards = []  # a damaged reward row: no reward can be trusted (store.problems() names it)
    scored = np.array([r for r in rewards if r is not None], dtype=np.float64)
    sizes = {s.stem: s.path.stat().st_size for s in shards}
    size = sum(sizes.values())
    n_live = sum(s.live for s in shards)
    runs = sorted({f"{s.experiment}/{s.trial}" for s in shards})
    damaged = sum(len(s.index) for s in shards) - len(index)
    lines = [
        f"{store.path}: {len(shards)} shards ({len(shards) - n_live} finalised, {n_live} live), "
        f"{len(index):,} trajectories{f' (+{damaged:,} with a damaged index row)' if damaged else ''}, "
        f"{int(index['token_count'].sum()):,} tokens "
        f"({int(index['n_output'].sum()):,} output), {_bytes(size)}; runs: {', '.join(runs)}",
        "",
    ]
    lines.append(
        f"{'shard':<28} {'state':<10} {'trajectories':>12} {'tokens':>12} {'rewards':>8} {'size':>10} {'torn':>5}"
    )
    for s in shards:
        lines.append(
            f"{s.path.name:<28} {'live' if s.live else 'finalised':<10} {len(s.index):>12,} "
            f"{s.n_tokens:>12,} {len(s.rewards):>8,} {_bytes(sizes[s.stem]):>10} "
            f"{s.torn_trajectories:>5}"
        )
    tenants, counts = np.unique(index["tenant"], return_counts=True)
    lines += ["", "tenants: " + ", ".join(f"{text(t)} {c:,}" for t, c in zip(tenants, counts))]
    if len(index):
        lengths = index["n_output"]
        lines.append(
            f"output tokens per trajectory: min {lengths.min():,}, median {int(np.median(lengths)):,}, "
            f"max {lengths.max():,}"
        )
    if rewards or not len(index):
        lines += ["", f"reward ({len(scored):,} scored, {len(index) - len(scored):,} awaiting a reward):"]
        lines += _histogram(scored)
    else:
        lines += ["", "reward: not shown (a reward row fails its checksum)"]
    lines += ["", "policy version of the newest output token:"]
    lines += _histogram(index["version_max"][index["version_max"] >= 0], label=lambda v: f"v{v}")
    torn = [f"{s.path.name}: {s.torn}" for s in shards if s.torn]
    lines += ["", "torn tails: " + ("; ".join(torn) or "none")]
    return "\n".join(lines)


def verify(path: Path, metadata_wait: float = METADATA_WAIT) -> tuple[list[str], list[str], int]:
    """Check every shard under ``path``, one at a time: that HDF5 can open and read it, that a live
    one holds every byte it committed, every index and reward row and every record against its CRC32,
    the commit counts, finalised shards against their manifest. Returns (damage, notes, committed
    records checked)."""
    paths = shard_paths(path)
    if not paths:
        raise UserError(f"{path} holds no trajectory shards (*.h5)")
    damage, notes, listed = [], [], {}
    for manifest_path in _manifests(path):
        try:
            entries = _manifest_entries(manifest_path)
        except ValueError as exc:
            damage.append(f"{manifest_path.name}: {exc}")
            continue
        listed |= {
            entry["name"]: (manifest_path.name, entry)
            for entry in entries
            if path.is_dir() or entry["name"] == path.name
        }
    seen, records = set(), 0
    columns = [
        TextColumn("verify"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("shards, {task.fields[records]:,} records"),
    ]
    console = Console(stderr=True)  # stdout stays the report; a bar only on a terminal
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        bar = progress.add_task("verify", total=len(paths), records=0)
        for shard_path in paths:
            name = shard_path.name
            try:
                shard = open_listed(shard_path, metadata_wait)
                if shard is not None:
                    with shard:
                        name = shard.path.name  # the finalised name, if its writer renamed it meanwhile
                        records += len(shard.index)
                        damage += _shard_damage(shard, listed.get(name))
                        notes += _shard_notes(shard, listed_somewhere=name in listed or path.is_file())
                    seen.add(name)
            except ShardDamageError as exc:  # unopenable, or HDF5 failed part-way (damaged metadata)
                damage.append(str(exc))
                seen.add(name)
            progress.update(bar, advance=1, records=records)
    damage += [
        f"{name}: listed in {manifest} but missing" for name, (manifest, _) in listed.items() if name not in seen
    ]
    return damage, notes, records


def _shard_damage(shard: ShardFile, listing: tuple[str, dict] | None) -> list[str]:
    """Damage to what ``shard`` committed: rows failing a check, impossible commit counts, changes
    since it was finalised (``listing``: its manifest's name and entry)."""
    name = shard.path.name
    found = [f"{name} row {r}: {problem}" for r, problem in shard.damaged_rows()]
    found += [f"{name} reward row {r}: fails its checksum" for r in np.flatnonzero(~shard.rewards_intact)]
    behind = [n for n in COUNTED if shard.intended[n] < shard.committed[n]]
    if behind:
        found.append(f"{name}: commit counts impossible (more {behind[0]} committed than ever intended)")
    elif shard.torn and not shard.live:
        found.append(f"{name}: finalised, yet it holds an unfinished commit ({shard.torn})")
    if listing is not None:
        found += _check_manifest_entry(shard, *listing)
    return found


def _shard_notes(shard: ShardFile, listed_somewhere: bool) -> list[str]:
    """What a crash or a running writer leaves by design: nothing committed is lost."""
    name, notes = shard.path.name, []
    if shard.live:
        notes.append(f"{name}: live (its writer is still writing, or stopped without finalising)")
        if shard.torn:
            notes.append(
                f"{name}: torn tail, {shard.torn}: its writer stopped mid-commit (or is committing "
                "right now); nothing committed is lost"
            )
    elif not listed_somewhere:
        notes.append(f"{name}: finalised but in no manifest (writer stopped before recording it)")
    return notes


def export_jsonl(store: TrajectoryStore, out: TextIO, where: TrajectoryFilter) -> int:
    n = 0
    for traj in store.trajectories(where):
        out.write(json.dumps(trajectory_to_json(traj)) + "\n")
        n += 1
    return n


def export_text(store: TrajectoryStore, out: TextIO, where: TrajectoryFilter, tokenizer) -> int:
    n = 0
    for traj in store.trajectories(where):
        out.write(trajectory_text(traj, tokenizer) + "\n")
        n += 1
    return n


ROLE = re.compile(r"<\|im_start\|>(\w+)\n.*?<\|im_end\|>", re.S)  # a whole ChatML message (Qwen's templates)


def trajectory_text(traj: Trajectory, tokenizer) -> str:
    """A record as text: a header, then its segments in order, each decoded with its special tokens (the
    chat template's role markers): the environment's tokens as context (never trained) with the roles of
    the messages they hold, the model's as a turn with its trained share, versions and reward; output
    tokens a loss mask leaves out are shown in ``[not trained: ...]``."""
    trained = sum(int(s.loss_mask.sum()) for s in traj.segments)
    rewards = {r.step: r.value for r in traj.rewards}
    lines = [
        f"=== trajectory {traj.id}  task {traj.task or '-'}  group {traj.group_id or '-'}  reward {traj.reward}  "
        f"{len(traj.segments)} turns, {traj.n_tokens} tokens, {trained} of {traj.n_output_tokens} output tokens trained"
    ]
    for turn, segment in enumerate(traj.segments, 1):
        if len(segment.input_ids):
            context = tokenizer.decode(segment.input_ids.tolist(), skip_special_tokens=False)
            roles = "".join(f" {role}" for role in ROLE.findall(context))
            lines += [f"--- context{roles}: {len(segment.input_ids)} tokens, not trained", context]
        versions = sorted({int(v) for v in segment.output_versions})
        made = "-".join(str(v) for v in dict.fromkeys(versions[:1] + versions[-1:])) or "-"
        lines += [
            f"--- model turn {turn}: {len(segment.output_ids)} tokens, {int(segment.loss_mask.sum())} trained, "
            f"policy version {made}, reward {rewards.get(turn - 1, '-')}",
            _masked_text(segment.output_ids.tolist(), segment.loss_mask.tolist(), tokenizer),
        ]
    return "\n".join(lines)


def _masked_text(ids: list[int], mask: list[int], tokenizer) -> str:
    """``ids`` decoded, each run of untrained tokens (mask 0) wrapped in ``[not trained: ...]``."""
    parts = []
    for trained, pairs in itertools.groupby(zip(ids, mask), key=lambda pair: pair[1]):
        decoded = tokenizer.decode([token for token, _ in pairs], skip_special_tokens=False)
        parts.append(decoded if trained else f"[not trained: {decoded}]")
    return "".join(parts)


def shard_tokenizer(path: str | Path, folder: str | Path | None = None):
    """The tokenizer in ``folder``, else that of the run that wrote the shards at ``path`` (a shard or a
    shards folder): the one its resolved config (``<run>/config.yaml``) names (``tokenizer.path``, else
    ``model.path``), else the run's own ``init_model``."""
    from transformers import AutoTokenizer

    if folder is None:
        start = Path(path).resolve()
        run = next((f for f in [start, *start.parents][:3] if (f / "config.yaml").is_file()), None)
        if run is None:
            raise UserError(f"{path} is in no run folder (with a config.yaml): give --tokenizer DIR, a model folder")
        config = yaml.safe_load((run / "config.yaml").read_text()) or {}
        named = (config.get("tokenizer") or {}).get("path") or (config.get("model") or {}).get("path")
        folder = named or run / "init_model"
    if not (Path(folder) / "tokenizer_config.json").is_file():
        raise UserError(f"{folder} holds no tokenizer (no tokenizer_config.json): give --tokenizer DIR, a model folder")
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def trajectory_to_json(traj: Trajectory) -> dict:
    return {
        "id": traj.id,
        "experiment": traj.experiment,
        "trial": traj.trial,
        "task": traj.task,
        "group_id": traj.group_id,
        "session_id": traj.session_id,
        "tenant": traj.tenant,
        "eligible": traj.eligible,
        "created": traj.created,
        "reward": traj.reward,
        "rewards": [{"step": r.step, "value": r.value, "source": r.source, "time": r.time} for r in traj.rewards],
        "segments": [
            {
                "input_ids": s.input_ids.tolist(),
                "output_ids": s.output_ids.tolist(),
                "output_logprobs": s.output_logprobs.tolist(),
                "output_versions": s.output_versions.tolist(),
                "loss_mask": s.loss_mask.tolist(),
                "temperature": s.temperature,
            }
            for s in traj.segments
        ],
        "metadata": traj.metadata,
        "redactions": traj.redactions,
    }


def _check_manifest_entry(shard: ShardFile, manifest_name: str, entry: dict) -> list[str]:
    found = {
        "trajectories": len(shard.index),
        "tokens": shard.n_tokens,
        "rewards": len(shard.rewards),
        "bytes": shard.path.stat().st_size,
        "index_crc32": zlib.crc32(shard.index),
        "rewards_crc32": zlib.crc32(shard.rewards),
    }
    return [
        f"{shard.path.name}: {key} is {value}, {manifest_name} recorded {entry[key]} (changed after finalising)"
        for key, value in found.items()
        if value != entry[key]
    ]


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
        labels = [f"[{lo:.3g}, {hi:.3g})" for lo, hi in itertools.pairwise(edges)]
    width = max(len(text) for text in labels)
    top = max(counts)
    return [
        f"  {text:>{width}} {'#' * max(1, round(BAR_WIDTH * c / top)) if c else '':<{BAR_WIDTH}} {c:,}"
        for text, c in zip(labels, counts)
    ]


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
