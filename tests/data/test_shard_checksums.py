"""Checksums of live shards (a crashed writer's shard stays live forever): any changed byte of committed
data is reported by verify and never returned by the reader. The bytes are found and flipped with
raw file writes, and a second reader written from the format's description checks the checksums."""

import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hpc.data.shards import ShardDamageError, TrajectoryShardWriter, TrajectoryStore
from areal_hpc.data.shards.format import COLUMNS, INDEX_DTYPE, REWARD_DTYPE, SCHEMA_VERSION
from areal_hpc.data.shards.report import verify
from tests.conftest import REPO, run_cli
from tests.shard_processes import make_trajectory

SHARD = "w0-000000.live.h5"


def crashed_writer_folder(folder: Path, count: int = 4, seed: int = 21) -> Path:
    """A folder whose writer process ended without finalising: its shard stays ``.live.h5``."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.shard_processes",
            "write",
            str(folder),
            str(seed),
            str(count),
            "--exit-without-close",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return folder / SHARD


def committed_bytes(path: Path, name: str) -> int:
    """How many bytes of a dataset the last commit covers (the committed counts, read raw)."""
    with h5py.File(path, "r", swmr=True) as f:
        state = f["state"][:]
    counter = ["index", "tokens", "headers", "rewards"].index(COLUMNS[name].counter)
    return int(state[counter]) * COLUMNS[name].dtype.itemsize


def file_offset(path: Path, name: str, byte: int) -> int:
    """Where byte ``byte`` of dataset ``name`` (a flat u1 or byte-packed dataset) lies in the file."""
    with h5py.File(path, "r", swmr=True) as f:
        dataset = f[name]
        width = dataset.chunks[0] * dataset.dtype.itemsize
        chunk = dataset.id.get_chunk_info_by_coord((byte // width * dataset.chunks[0],))
        return chunk.byte_offset + byte % width


def raw_committed(path: Path, name: str) -> bytes:
    """The committed bytes of a dataset, read from the file chunk by chunk (chunks are stored unfiltered)."""
    size, out = committed_bytes(path, name), bytearray()
    with h5py.File(path, "r", swmr=True) as f, open(path, "rb") as fh:
        dataset = f[name]
        width = dataset.chunks[0] * dataset.dtype.itemsize
        for start in range(0, size, width):
            fh.seek(dataset.id.get_chunk_info_by_coord((start // dataset.dtype.itemsize,)).byte_offset)
            out += fh.read(min(width, size - start))
    return bytes(out)


def flip(path: Path, name: str, byte: int, mask: int = 0xFF) -> None:
    offset = file_offset(path, name, byte)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        value = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([value ^ mask]))


def field_byte(dtype: np.dtype, row: int, field: str) -> int:
    return row * dtype.itemsize + dtype.fields[field][1]


@pytest.mark.parametrize(
    "dataset, dtype, field, byte, mask",
    [
        ("index", INDEX_DTYPE, "eligible", 0, 0x01),
        ("index", INDEX_DTYPE, "version_max", 0, 0x01),
        ("rewards", REWARD_DTYPE, "value", 7, 0xFF),  # trajectory 1's reward 1.0 becomes -65536.0 (seen in the issue)
        ("rewards", REWARD_DTYPE, "id", 5, 0x01),  # "s21-t1" becomes "s21-t0": another stored trajectory's id
    ],
)
def test_a_flipped_field_of_a_live_shard_is_damage_never_a_value(tmp_path, dataset, dtype, field, byte, mask):
    shard = crashed_writer_folder(tmp_path)
    flip(shard, dataset, field_byte(dtype, 1, field) + byte, mask)
    result = run_cli("shards", "verify", str(tmp_path))
    assert result.returncode == 1, result.stdout
    row = "row 1: index row fails its checksum" if dataset == "index" else "reward row 1: fails its checksum"
    assert f"DAMAGE: {SHARD} {row}" in result.stdout
    with TrajectoryStore(tmp_path) as store, pytest.raises(ShardDamageError, match="fails its checksum"):
        list(store.trajectories())


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return crashed_writer_folder(tmp_path_factory.mktemp("pristine"), count=3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), mask=st.integers(1, 255))
def test_any_changed_byte_of_committed_data_is_caught(pristine, tmp_path_factory, data, mask):
    # every byte a commit covers, in all four record datasets (the commit counts are not checksummed)
    sizes = {name: committed_bytes(pristine, name) for name in ("tokens", "headers", "index", "rewards")}
    name = data.draw(st.sampled_from(sorted(sizes)))
    byte = data.draw(st.integers(0, sizes[name] - 1))
    folder = tmp_path_factory.mktemp("flipped")
    shutil.copy(pristine, folder / SHARD)
    flip(folder / SHARD, name, byte, mask)
    damage, _, _ = verify(folder)
    assert damage, (name, byte)
    with TrajectoryStore(folder) as store, pytest.raises(ShardDamageError):
        list(store.trajectories())


def test_checksums_follow_the_format_description(tmp_path):
    """A second reader, from format.py's description only: raw bytes, struct and zlib."""
    shard = crashed_writer_folder(tmp_path, count=5)
    raw = {name: raw_committed(shard, name) for name in ("tokens", "headers", "index", "rewards")}
    index_row, reward_row = INDEX_DTYPE.itemsize, REWARD_DTYPE.itemsize
    for rows, width in ((raw["index"], index_row), (raw["rewards"], reward_row)):
        assert len(rows) % width == 0 and len(rows) > 0
        for start in range(0, len(rows), width):  # each row ends with the little-endian CRC32 of the rest
            end = start + width
            assert struct.unpack("<I", rows[end - 4 : end])[0] == zlib.crc32(rows[start : end - 4])
    token_layout = struct.Struct("<ifB")  # (id i4, logprob f4, loss_mask u1), packed
    for start in range(0, len(raw["index"]), index_row):
        row = raw["index"][start : start + index_row]
        token_start, token_count, header_start, header_count, crc = struct.unpack_from("<qqqqI", row, 128)
        tokens = [token_layout.unpack_from(raw["tokens"], (token_start + i) * 9) for i in range(token_count)]
        columns = b"".join(
            struct.pack(f"<{token_count}{code}", *(t[k] for t in tokens)) for k, code in enumerate("ifB")
        )
        assert crc == zlib.crc32(raw["headers"][header_start : header_start + header_count], zlib.crc32(columns))


def test_shards_of_the_first_schema_are_refused_in_one_line(tmp_path):
    with TrajectoryShardWriter(tmp_path, "w0") as writer:
        writer.append(make_trajectory(22, 0))
    with h5py.File(tmp_path / "w0-000000.h5", "r+") as f:
        f.attrs["schema_version"] = 1
    for action in ("inspect", "verify", "export"):
        result = run_cli("shards", action, str(tmp_path))
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert (
            f"uses trajectory schema version 1; this areal-hpc reads version {SCHEMA_VERSION} (its index and "
            "reward rows carry no checksum"
        ) in result.stderr
