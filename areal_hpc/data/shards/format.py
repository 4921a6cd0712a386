"""On-disk layout of a trajectory shard (one HDF5 file) and the record <-> arrays codec.

Datasets (all 1-D, chunked, extendible, created before SWMR mode starts):
  tokens   (id i4, logprob f4, loss_mask u1) per token: every trajectory's segments back to back
           (input tokens carry logprob 0 and mask 0)
  headers  u1: one JSON object per trajectory (ids, metadata, redactions, and per segment
           [n_input, n_output, version runs] with its sampling temperature appended where the record
           has one; a segment without, as every segment written before temperatures were, reads as
           None: the run's temperature)
  index    one fixed-width row per trajectory: where its tokens and header are, the record's CRC32
           (token rows and header bytes), filter columns, and last the row's own CRC32
  rewards  one row per reward event, keyed by trajectory id (late rewards land in any live shard),
           last the row's own CRC32
  state    i8[8]: committed counts of (index, tokens, headers, rewards), then the intended counts
``tokens``, ``index`` and ``rewards`` rows are stored as their bytes (numpy layout in the ``row_dtype``
attribute): HDF5 spends ~20 us converting a compound type on every write, more than the write, and
one packed token write per commit instead of one per field keeps per-trajectory flushes cheap.

A commit writes the intended counts, the data, flushes HDF5 metadata, fsyncs, then writes the
committed counts and fsyncs again. Raw data bypasses HDF5's buffers, so each step is in the file
before the next begins (a killed process), and the fsyncs put it on disk in that order (a crashed
node): a reader trusts only committed rows, and intended > committed marks a torn tail.
Every index and reward row ends with the CRC32 of its other bytes (``seal``), so damage to a filter
column or a reward is caught in live shards too, which no manifest covers yet. HDF5 checksums its own
metadata; text attributes are stored fixed-length (``fixed_text``) so that they are part of it. A reader
of a live shard re-reads metadata failing its checksum for a bounded time (``read_attempts``), then
calls it damage, and checks that the file still holds every committed byte (``reader.py``).
Flat arrays plus offsets rather than variable-length datasets: SWMR readers of vlen data fail
intermittently with HDF5 2.0 (ENVIRONMENT.md). No compression filter: with a flush per trajectory
every partial chunk is re-compressed and re-allocated at each flush (measured with lzf: files 5x the
raw size, 0.03x raw write speed); the versions, the one column that compresses well, are stored as runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from areal_hpc.data.trajectory import (
    MAX_ID_BYTES,
    MAX_SOURCE_BYTES,
    Reward,
    Segment,
    Trajectory,
    expand_version_runs,
    version_runs,
)
from areal_hpc.errors import UserError
from areal_hpc.fsio import fsync_path

FORMAT = "areal-hpc/trajectory-shard"
SCHEMA_VERSION = 2  # 2: index and reward rows carry their own CRC32
LIVE_SUFFIX = ".live.h5"  # a shard its writer still appends to (or a writer that died)
FINAL_SUFFIX = ".h5"
METADATA_WAIT = 1.0  # seconds a live shard's reader re-reads metadata failing its checksum before calling it damage

TOKEN_DTYPE = np.dtype([("id", "<i4"), ("logprob", "<f4"), ("loss_mask", "u1")])
INDEX_DTYPE = np.dtype(
    [
        ("id", f"S{MAX_ID_BYTES}"),
        ("tenant", f"S{MAX_ID_BYTES}"),
        ("token_start", "<i8"),
        ("token_count", "<i8"),
        ("header_start", "<i8"),
        ("header_count", "<i8"),
        ("crc32", "<u4"),
        ("created", "<f8"),
        ("version_min", "<i4"),
        ("version_max", "<i4"),
        ("n_output", "<i8"),
        ("eligible", "u1"),
        ("row_crc32", "<u4"),
    ]
)
REWARD_DTYPE = np.dtype(
    [
        ("id", f"S{MAX_ID_BYTES}"),
        ("step", "<i4"),
        ("value", "<f8"),
        ("source", f"S{MAX_SOURCE_BYTES}"),
        ("time", "<f8"),
        ("crc32", "<u4"),
    ]
)
COUNTED = ("index", "tokens", "headers", "rewards")  # order of the counts in the state dataset


@dataclass(frozen=True)
class Column:
    """One appendable dataset: the dtype of an entry, which count indexes it, entries per chunk."""

    dtype: np.dtype
    counter: str
    chunk: int

    @property
    def as_bytes(self) -> bool:
        return self.dtype.names is not None


COLUMNS = {
    "tokens": Column(TOKEN_DTYPE, "tokens", 1 << 14),
    "headers": Column(np.dtype("u1"), "headers", 1 << 16),
    "index": Column(INDEX_DTYPE, "index", 256),
    "rewards": Column(REWARD_DTYPE, "rewards", 256),
}


class ShardDamageError(UserError):
    """A shard whose bytes are damaged: unopenable, truncated, or a record failing its checksum."""


def text(field: bytes) -> str:
    """A fixed-width id/name column as text; damaged bytes never raise (checks catch the mismatch)."""
    return field.decode(errors="replace")


def shard_stem(path: Path) -> str:
    """The name a shard keeps from live to finalised (``rollout0-000003``)."""
    name = path.name
    return name[: -len(LIVE_SUFFIX)] if name.endswith(LIVE_SUFFIX) else name[: -len(FINAL_SUFFIX)]


def create_shard(path: Path, experiment: str, trial: str, writer: str, durable: bool) -> h5py.File:
    """Create an empty shard with every dataset in SWMR mode; readers only ever see it ready.

    It is built under a hidden name and linked into place once SWMR writing has started, since a
    reader cannot open a file that is still open for ordinary writing. ``durable``: fsync the file
    and the folder, so the name survives a node crash.
    """
    staging = path.with_name(f".{path.name}.tmp")
    f = h5py.File(h5py.h5f.create(str(staging).encode(), h5py.h5f.ACC_TRUNC, fapl=_unbuffered_access()))
    f.attrs.update(
        format=fixed_text(FORMAT),
        schema_version=SCHEMA_VERSION,
        experiment=fixed_text(experiment),
        trial=fixed_text(trial),
        writer=fixed_text(writer),
    )
    for name, column in COLUMNS.items():
        scale = column.dtype.itemsize if column.as_bytes else 1
        dataset = f.create_dataset(
            name,
            shape=(0,),
            maxshape=(None,),
            chunks=(column.chunk * scale,),
            dtype="u1" if column.as_bytes else column.dtype,
        )
        if column.as_bytes:
            dataset.attrs["row_dtype"] = fixed_text(json.dumps(column.dtype.descr))
    f.create_dataset("state", data=np.zeros(2 * len(COUNTED), dtype="<i8"))
    f.swmr_mode = True
    if durable:
        os.fsync(f.id.get_vfd_handle())
    try:
        os.link(staging, path)  # unlike a rename, never replaces a shard someone else is writing
    except FileExistsError:
        f.close()
        raise UserError(
            f"{path} already exists: is another writer using id {writer!r} in this folder? "
            "Give each process its own writer id"
        ) from None
    finally:
        staging.unlink()
    if durable:
        fsync_path(path.parent)
    return f


def fixed_text(value: str) -> np.ndarray:
    """A text attribute stored fixed-length, inside its object header, which HDF5 checksums. Python
    strings become variable-length ones, kept in HDF5's global heap: no checksum, and HDF5 2.0 loops
    forever on some damaged heaps (older shards hold theirs there: ``attribute_text`` reads both)."""
    encoded = value.encode()
    return np.array(encoded, dtype=h5py.string_dtype("utf-8", max(1, len(encoded))))


def attribute_text(value: bytes | str) -> str:
    """A text attribute as written by ``fixed_text`` (read as bytes) or as a variable-length string."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _unbuffered_access() -> h5py.h5p.PropFAID:
    """Raw data goes straight to the OS: no chunk cache (it would rewrite whole chunks at every
    flush) and no sieve buffer (so the ``state`` counts are in the file the moment they are written).
    Only metadata waits for ``flush()``, which is what the commit protocol orders."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_cache(0, 0, 0, 0.75)
    fapl.set_sieve_buf_size(0)
    fapl.set_file_locking(True, True)  # lock where the filesystem can, carry on where it cannot
    return fapl


def open_shard(path: Path, metadata_wait: float = METADATA_WAIT) -> h5py.File:
    """Open a shard read-only, or say clearly why not.

    Live shards (and those a dead writer left) open in SWMR mode so they can be tailed. Finalised
    ones open normally: HDF5 then checks the file end, which SWMR skips, so a truncated copy is
    refused at once instead of reading as zeros. A SWMR reader re-reads metadata failing its
    checksum (the writer may be rewriting it); ``metadata_wait`` bounds how long (see ``read_attempts``).
    """
    if not path.exists():
        raise UserError(f"no such file or directory: {path}")
    if not h5py.is_hdf5(path):
        if path.name.endswith(LIVE_SUFFIX):  # only a writer names a file so, once it is a complete shard
            raise ShardDamageError(f"{path}: HDF5 cannot open it (no HDF5 signature: truncated or damaged)")
        raise UserError(f"{path} is not an HDF5 file")
    access = _read_access(metadata_wait)
    with hdf5_damage(path, "open"):  # truncated or damaged beyond HDF5's own structure, or gone meanwhile
        try:
            f = _open_read_only(path, access, swmr=path.name.endswith(LIVE_SUFFIX))
        except OSError as exc:
            if "already open for write" not in str(exc):
                raise
            f = _open_read_only(path, access, swmr=True)  # a live shard renamed by hand
        try:
            _check_schema(path, f)
        except BaseException:
            f.close()
            raise
    return f


@contextlib.contextmanager
def hdf5_damage(path: Path, action: str = "read") -> Iterator[None]:
    """h5py's errors on a shard's own structure (damaged metadata, missing bytes) as one ShardDamageError.

    h5py raises OSError, KeyError, RuntimeError or ValueError depending on where HDF5 failed: keep
    the block to HDF5 calls, so that no error of the caller's own is called damage."""
    try:
        yield
    except (OSError, KeyError, RuntimeError, ValueError) as exc:
        reason = str(exc.args[0]) if exc.args else type(exc).__name__
        raise ShardDamageError(f"{path}: HDF5 cannot {action} it ({reason.splitlines()[0]})") from exc


def read_attempts(metadata_wait: float) -> int:
    """How many times a SWMR reader reads a metadata block failing its checksum: HDF5 sleeps 1, 2, 4...
    ns after each try, so n tries wait 2**n - 1 ns in all (less than twice ``metadata_wait`` seconds).
    HDF5's default of 100 tries would wait 2**100 ns: a damaged byte in a live shard hung every reader."""
    if metadata_wait < 0:
        raise ValueError(f"metadata_wait must be >= 0 seconds, got {metadata_wait}")
    return max(1, math.ceil(math.log2(metadata_wait * 1e9 + 1)))


def _read_access(metadata_wait: float) -> h5py.h5p.PropFAID:
    """File access for readers; the read attempts apply to SWMR opens only (HDF5 makes it 1 otherwise)."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_file_locking(True, True)  # lock where the filesystem can, carry on where it cannot
    if _set_metadata_read_attempts()(fapl.id, read_attempts(metadata_wait)) < 0:
        raise RuntimeError("HDF5 refused H5Pset_metadata_read_attempts")
    return fapl


def _open_read_only(path: Path, access: h5py.h5p.PropFAID, swmr: bool) -> h5py.File:
    flags = h5py.h5f.ACC_RDONLY | (h5py.h5f.ACC_SWMR_READ if swmr else 0)
    return h5py.File(h5py.h5f.open(str(path).encode(), flags, fapl=access))


@functools.cache
def _set_metadata_read_attempts():
    """HDF5's ``H5Pset_metadata_read_attempts``, which h5py does not wrap. Looked up through one of h5py's
    own extension modules, so the symbol comes from the HDF5 library h5py loaded (one with its own
    identifier space: another copy of HDF5 would not know the property list)."""
    function = ctypes.CDLL(h5py.h5p.__file__).H5Pset_metadata_read_attempts
    function.argtypes, function.restype = [ctypes.c_int64, ctypes.c_uint], ctypes.c_int  # hid_t is 64-bit
    return function


def _check_schema(path: Path, f: h5py.File) -> None:
    if attribute_text(f.attrs.get("format", "")) != FORMAT:
        raise UserError(f"{path} is an HDF5 file but not an areal-hpc trajectory shard")
    version = int(f.attrs["schema_version"])
    if version != SCHEMA_VERSION:
        remedy = (
            "upgrade areal-hpc to read it"
            if version > SCHEMA_VERSION
            else "its index and reward rows carry no checksum; export it with an areal-hpc from before schema 2, "
            "e.g. git commit ffe43b9"
        )
        raise UserError(
            f"{path} uses trajectory schema version {version}; this areal-hpc reads version {SCHEMA_VERSION} ({remedy})"
        )


def encode(traj: Trajectory) -> tuple[dict[str, list[np.ndarray]], np.ndarray, np.ndarray]:
    """Token field pieces, header bytes and the index row (offsets left to the writer).

    Pieces rather than packed rows: the writer packs every pending record's pieces in one copy.
    """
    parts: dict[str, list[np.ndarray]] = {name: [] for name in TOKEN_DTYPE.names}
    runs = []
    for seg in traj.segments:
        n_in = len(seg.input_ids)
        parts["id"] += [seg.input_ids, seg.output_ids]
        parts["logprob"] += [np.zeros(n_in, np.float32), seg.output_logprobs]
        parts["loss_mask"] += [np.zeros(n_in, np.uint8), seg.loss_mask]
        runs.append(version_runs(seg.output_versions))
    header = np.frombuffer(
        json.dumps(
            {
                "id": traj.id,
                "tenant": traj.tenant,
                "task": traj.task,
                "group_id": traj.group_id,
                "session_id": traj.session_id,
                "created": traj.created,
                "segments": [
                    [len(s.input_ids), len(s.output_ids), r] + ([] if s.temperature is None else [s.temperature])
                    for s, r in zip(traj.segments, runs)
                ],
                "metadata": traj.metadata,
                "redactions": traj.redactions,
            },
            separators=(",", ":"),
        ).encode(),
        dtype=np.uint8,
    )
    versions = [v for segment_runs in runs for _, v in segment_runs] or [-1]
    crc = checksum([piece for name in TOKEN_DTYPE.names for piece in parts[name]] + [header])
    row = np.array(
        [
            (
                traj.id.encode(),
                traj.tenant.encode(),
                0,
                traj.n_tokens,
                0,
                len(header),
                crc,
                traj.created,
                min(versions),
                max(versions),
                traj.n_output_tokens,
                traj.eligible,
                0,
            )
        ],
        dtype=INDEX_DTYPE,
    )
    return parts, header, row  # sealed by the writer once the offsets are known


def pack_tokens(parts: list[dict[str, list[np.ndarray]]], n_tokens: int) -> np.ndarray:
    """Token rows of several records' pieces, back to back."""
    tokens = np.empty(n_tokens, dtype=TOKEN_DTYPE)
    for name in TOKEN_DTYPE.names:
        position = 0
        for record in parts:
            for piece in record[name]:
                tokens[name][position : position + len(piece)] = piece
                position += len(piece)
    return tokens


def decode(
    row: np.void, tokens: np.ndarray, meta: dict, experiment: str, trial: str, rewards: list[Reward]
) -> Trajectory:
    """Rebuild a record from its index row, token rows and parsed header (all checked)."""
    segments, position = [], 0
    for n_in, n_out, runs, *temperature in meta["segments"]:
        out = tokens[position + n_in : position + n_in + n_out]
        segments.append(
            Segment(
                input_ids=tokens["id"][position : position + n_in],
                output_ids=out["id"],
                output_logprobs=out["logprob"],
                loss_mask=out["loss_mask"],
                output_versions=expand_version_runs(runs, n_out),
                temperature=temperature[0] if temperature else None,
            )
        )
        position += n_in + n_out
    return Trajectory(
        segments=segments,
        id=meta["id"],
        task=meta["task"],
        group_id=meta["group_id"],
        session_id=meta["session_id"],
        tenant=meta["tenant"],
        rewards=rewards,
        metadata=meta["metadata"],
        eligible=bool(row["eligible"]),
        redactions=meta["redactions"],
        experiment=experiment,
        trial=trial,
        created=meta["created"],
    )


def record_checksum(tokens: np.ndarray, header: np.ndarray) -> int:
    """The CRC32 ``encode`` computed, recomputed from stored token rows and header bytes."""
    return checksum([np.ascontiguousarray(tokens[name]) for name in TOKEN_DTYPE.names] + [header])


def checksum(arrays: list[np.ndarray]) -> int:
    """CRC32 of arrays back to back: the same for a record's pieces and for its joined columns."""
    crc = 0
    for array in arrays:
        crc = zlib.crc32(np.ascontiguousarray(array), crc)
    return crc


def seal(rows: np.ndarray) -> np.ndarray:
    """Set each row's last field (a ``<u4``) to the CRC32 of the row's bytes before it; returns ``rows``."""
    rows[rows.dtype.names[-1]] = _row_checksums(rows)
    return rows


def intact(rows: np.ndarray) -> np.ndarray:
    """Which rows still match the CRC32 ``seal`` stored in their last field."""
    return _row_checksums(rows) == rows[rows.dtype.names[-1]]


def _row_checksums(rows: np.ndarray) -> np.ndarray:
    covered = rows.dtype.fields[rows.dtype.names[-1]][1]  # every byte before the checksum field
    raw = memoryview(
        np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), rows.dtype.itemsize)[:, :covered].tobytes()
    )
    return np.array([zlib.crc32(raw[i * covered : (i + 1) * covered]) for i in range(len(rows))], dtype="<u4")


def reward_row(trajectory_id: str, reward: Reward) -> np.ndarray:
    row = np.zeros(1, dtype=REWARD_DTYPE)
    row[0] = (trajectory_id.encode(), reward.step, reward.value, reward.source.encode(), reward.time, 0)
    return seal(row)


def reward_from_row(row: np.void) -> Reward:
    return Reward(value=float(row["value"]), step=int(row["step"]), source=text(row["source"]), time=float(row["time"]))
