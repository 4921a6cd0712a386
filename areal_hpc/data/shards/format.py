"""On-disk layout of a trajectory shard (one HDF5 file) and the record <-> bytes codec.

Datasets (all 1-D, chunked, extendible, created before SWMR mode starts):
  tokens   (id i4, logprob f4, loss_mask u1) per token: every trajectory's segments back to back
           (input tokens carry logprob 0 and mask 0)
  headers  u1: one JSON object per trajectory (ids, segments, version runs, metadata, redactions)
  index    one fixed-width row per trajectory: where its tokens and header are, CRC32, filter columns
  rewards  one row per reward event, keyed by trajectory id (late rewards land in any live shard)
  state    i8[8]: committed counts, then intended counts (see ``State``)
A commit writes the intended counts, the data, then the committed counts, with a flush after each
step; a reader trusts only committed rows, and intended > committed marks a torn tail.
Flat arrays plus offsets rather than variable-length datasets: SWMR readers of vlen data fail
intermittently with HDF5 2.0 (ENVIRONMENT.md).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import h5py
import numpy as np

from areal_hpc.data.trajectory import (MAX_ID_BYTES, MAX_SOURCE_BYTES, Reward, Segment, Trajectory,
                                       expand_version_runs, version_runs)
from areal_hpc.errors import UserError

FORMAT = "areal-hpc/trajectory-shard"
SCHEMA_VERSION = 1
LIVE_SUFFIX = ".live.h5"  # a shard its writer still appends to (or a writer that died)
FINAL_SUFFIX = ".h5"

TOKEN_DTYPE = np.dtype([("id", "<i4"), ("logprob", "<f4"), ("loss_mask", "u1")])
INDEX_DTYPE = np.dtype([
    ("id", f"S{MAX_ID_BYTES}"), ("tenant", f"S{MAX_ID_BYTES}"),
    ("token_start", "<i8"), ("token_count", "<i8"), ("header_start", "<i8"), ("header_count", "<i8"),
    ("crc32", "<u4"), ("created", "<f8"), ("version_min", "<i4"), ("version_max", "<i4"),
    ("n_output", "<i8"), ("eligible", "u1"),
])
REWARD_DTYPE = np.dtype([("id", f"S{MAX_ID_BYTES}"), ("step", "<i4"), ("value", "<f8"),
                         ("source", f"S{MAX_SOURCE_BYTES}"), ("time", "<f8")])
DATASETS = {"tokens": (TOKEN_DTYPE, 1 << 14), "headers": (np.dtype("u1"), 1 << 14),
            "index": (INDEX_DTYPE, 256), "rewards": (REWARD_DTYPE, 256)}
COUNTED = ("index", "tokens", "headers", "rewards")  # order of the counts in the state dataset
# Raw chunk writes bypass HDF5's chunk cache: with it, every flush rewrites whole cached chunks.
FILE_KWARGS = dict(libver="latest", rdcc_nbytes=0, locking="best-effort")


def shard_stem(path: Path) -> str:
    """The name a shard keeps from live to finalised (``rollout0-000003``)."""
    name = path.name
    return name[: -len(LIVE_SUFFIX)] if name.endswith(LIVE_SUFFIX) else name[: -len(FINAL_SUFFIX)]


def create_shard(path: Path, experiment: str, trial: str, writer: str) -> h5py.File:
    """Create an empty shard with every dataset in SWMR mode; readers only ever see it ready.

    It is built under a hidden name and renamed into place once SWMR writing has started, since a
    reader cannot open a file that is still open for ordinary writing.
    """
    staging = path.with_name(f".{path.name}.tmp")
    f = h5py.File(staging, "w", **FILE_KWARGS)
    f.attrs.update(format=FORMAT, schema_version=SCHEMA_VERSION, experiment=experiment, trial=trial,
                   writer=writer)
    for name, (dtype, chunk) in DATASETS.items():
        f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(chunk,))
    f.create_dataset("state", data=np.zeros(2 * len(COUNTED), dtype="<i8"))
    f.swmr_mode = True
    os.replace(staging, path)
    return f


def open_shard(path: Path) -> h5py.File:
    """Open a shard read-only (SWMR, so live and crashed shards read too), or say clearly why not."""
    if not path.exists():
        raise UserError(f"no such file or directory: {path}")
    if not h5py.is_hdf5(path):
        raise UserError(f"{path} is not an HDF5 file")
    f = h5py.File(path, "r", swmr=True, locking="best-effort")
    if f.attrs.get("format") != FORMAT:
        f.close()
        raise UserError(f"{path} is an HDF5 file but not an areal-hpc trajectory shard")
    version = int(f.attrs["schema_version"])
    if version > SCHEMA_VERSION:
        f.close()
        raise UserError(f"{path} uses trajectory schema version {version}; this areal-hpc reads "
                        f"versions up to {SCHEMA_VERSION} (upgrade areal-hpc to read it)")
    return f


def encode(traj: Trajectory) -> tuple[np.ndarray, np.ndarray, np.void]:
    """Token rows, header bytes and the index row (offsets and created time left for the writer)."""
    tokens = np.zeros(traj.n_tokens, dtype=TOKEN_DTYPE)
    position = 0
    for seg in traj.segments:
        n_in, n_out = len(seg.input_ids), len(seg.output_ids)
        tokens["id"][position:position + n_in] = seg.input_ids
        out = slice(position + n_in, position + n_in + n_out)
        tokens["id"][out] = seg.output_ids
        tokens["logprob"][out] = seg.output_logprobs
        tokens["loss_mask"][out] = seg.loss_mask
        position += n_in + n_out
    header = np.frombuffer(json.dumps({
        "id": traj.id, "tenant": traj.tenant, "task": traj.task, "group_id": traj.group_id,
        "session_id": traj.session_id, "created": traj.created,
        "segments": [[len(s.input_ids), len(s.output_ids), version_runs(s.output_versions)]
                     for s in traj.segments],
        "metadata": traj.metadata, "redactions": traj.redactions,
    }, separators=(",", ":")).encode(), dtype=np.uint8)
    row = np.zeros((), dtype=INDEX_DTYPE)
    oldest, newest = traj.version_range
    row["id"], row["tenant"] = traj.id.encode(), traj.tenant.encode()
    row["token_count"], row["header_count"] = len(tokens), len(header)
    row["crc32"] = checksum(tokens, header)
    row["created"], row["version_min"], row["version_max"] = traj.created, oldest, newest
    row["n_output"], row["eligible"] = traj.n_output_tokens, traj.eligible
    return tokens, header, row


def decode(row: np.void, tokens: np.ndarray, header: np.ndarray, experiment: str, trial: str,
           rewards: list[Reward]) -> Trajectory:
    """Rebuild a record from its index row, token rows and header bytes (already checksummed)."""
    meta = json.loads(header.tobytes())
    segments, position = [], 0
    for n_in, n_out, runs in meta["segments"]:
        out = tokens[position + n_in: position + n_in + n_out]
        segments.append(Segment(input_ids=tokens["id"][position:position + n_in], output_ids=out["id"],
                                output_logprobs=out["logprob"], loss_mask=out["loss_mask"],
                                output_versions=expand_version_runs(runs, n_out)))
        position += n_in + n_out
    return Trajectory(segments=segments, id=meta["id"], task=meta["task"], group_id=meta["group_id"],
                      session_id=meta["session_id"], tenant=meta["tenant"], rewards=rewards,
                      metadata=meta["metadata"], eligible=bool(row["eligible"]),
                      redactions=meta["redactions"], experiment=experiment, trial=trial,
                      created=meta["created"])


def checksum(tokens: np.ndarray, header: np.ndarray) -> int:
    return zlib.crc32(header.tobytes(), zlib.crc32(tokens.tobytes()))


def reward_row(trajectory_id: str, reward: Reward) -> np.ndarray:
    row = np.zeros(1, dtype=REWARD_DTYPE)
    row[0] = (trajectory_id.encode(), reward.step, reward.value, reward.source.encode(), reward.time)
    return row


def reward_from_row(row: np.void) -> Reward:
    return Reward(value=float(row["value"]), step=int(row["step"]), source=row["source"].decode(),
                  time=float(row["time"]))
