"""Trajectory shards: round trip, filters, late rewards, rotation, manifests, tailing, damage, the CLI."""

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hpc.data.shards import (
    ConsumerCursor,
    ShardDamageError,
    TrajectoryConsumer,
    TrajectoryFilter,
    TrajectoryShardWriter,
    TrajectoryStore,
    UnknownTrajectoryError,
)
from areal_hpc.data.shards.format import INDEX_DTYPE, SCHEMA_VERSION
from areal_hpc.data.trajectory import Reward, Segment, Trajectory, expand_version_runs, version_runs
from areal_hpc.errors import UserError
from tests.conftest import REPO, run_cli
from tests.shard_processes import make_trajectory

FIELDS = ("id", "task", "group_id", "session_id", "tenant", "segments", "metadata", "eligible", "redactions")
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def same_record(a: Trajectory, b: Trajectory) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in FIELDS)


def write_all(directory, trajectories, **options):
    with TrajectoryShardWriter(directory, "w0", experiment="exp", trial="t1", **options) as writer:
        for traj in trajectories:
            writer.append(traj)
    return writer


@st.composite
def trajectories(draw, tenants=("a", "b", "c")):
    segments = []
    for _ in range(draw(st.integers(1, 3))):
        n_out = draw(st.integers(0, 40))
        versions = sorted(draw(st.lists(st.integers(0, 6), min_size=n_out, max_size=n_out)))
        floats = st.floats(-30, 0, width=32)
        segments.append(
            Segment(
                draw(st.lists(st.integers(0, 2**31 - 1), max_size=30)),
                draw(st.lists(st.integers(0, 2**31 - 1), min_size=n_out, max_size=n_out)),
                draw(st.lists(floats, min_size=n_out, max_size=n_out)),
                versions,
                draw(st.lists(st.integers(0, 1), min_size=n_out, max_size=n_out)),
                draw(st.none() | st.just(0.0) | st.floats(1e-6, 4.0)),
            )
        )
    return Trajectory(
        segments,
        tenant=draw(st.sampled_from(tenants)),
        task=draw(st.sampled_from(["", "countdown"])),
        group_id=draw(st.text(max_size=8)),
        session_id=draw(st.text(max_size=8)),
        metadata=draw(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3)),
        eligible=draw(st.booleans()),
        redactions=draw(
            st.lists(
                st.builds(lambda s, e: {"segment": 0, "start": s, "end": s + e}, st.integers(0, 5), st.integers(0, 5)),
                max_size=2,
            )
        ),
    )


@pytest.mark.smoke
@SETTINGS
@given(records=st.lists(trajectories(), max_size=12), flush_every=st.integers(1, 5), per_shard=st.integers(1, 6))
def test_round_trip_across_flush_and_rotation_settings(tmp_path_factory, records, flush_every, per_shard):
    directory = tmp_path_factory.mktemp("shards")
    write_all(directory, records, flush_every=flush_every, max_shard_trajectories=per_shard)
    with TrajectoryStore(directory) as store:
        back = list(store.trajectories())
    assert len(back) == len(records)
    assert all(same_record(a, b) for a, b in zip(records, back))
    assert all(b.experiment == "exp" and b.trial == "t1" and b.created > 0 for b in back)
    with TrajectoryStore(directory) as store:  # a shard rotates at the first commit that fills it
        sizes = [len(shard.index) for shard in store.shards.values()]
    assert all(per_shard <= n < per_shard + flush_every for n in sizes[:-1])


@SETTINGS
@given(
    records=st.lists(trajectories(), min_size=1, max_size=15),
    tenant=st.sampled_from(["a", "b", "c", "z"]),
    low=st.integers(0, 6),
    high=st.integers(0, 6),
)
def test_filters_return_exactly_the_matching_records(tmp_path_factory, records, tenant, low, high):
    directory = tmp_path_factory.mktemp("shards")
    write_all(directory, records, max_shard_trajectories=4)
    where = TrajectoryFilter(tenant=tenant, min_version=low, max_version=high, eligible_only=True)
    expected = [
        t.id
        for t in records
        if t.tenant == tenant and t.eligible and t.version_range[0] >= low and t.version_range[1] <= high
    ]
    with TrajectoryStore(directory) as store:
        assert [t.id for t in store.trajectories(where)] == expected
        assert all(t.tenant == tenant for t in store.trajectories(TrajectoryFilter(tenant=tenant)))
        picked = store.sample(3, np.random.default_rng(0), TrajectoryFilter(tenant=tenant))
    assert len({t.id for t in picked}) == len(picked) == min(3, sum(t.tenant == tenant for t in records))
    assert all(t.tenant == tenant for t in picked)


def test_a_segment_without_a_temperature_is_stored_as_before_temperatures_and_reads_as_the_runs(tmp_path):
    """Shards written before temperatures were recorded hold [n_input, n_output, version runs] per segment:
    those read as None (the run's temperature); a recorded temperature is a fourth entry."""
    write_all(
        tmp_path,
        [
            Trajectory([Segment([1], [2], [-0.1], [0])], id="old"),
            Trajectory([Segment([1], [2], [-0.1], [0], temperature=0.5), Segment([3], [4], [-0.2], [0])], id="proxy"),
        ],
    )
    (shard,) = tmp_path.glob("*.h5")
    with h5py.File(shard) as f:
        headers = f["headers"][:].tobytes()
    assert b'"segments":[[1,1,[[0,0]]]]' in headers and b'"segments":[[1,1,[[0,0]],0.5],[1,1,[[0,0]]]]' in headers
    with TrajectoryStore(tmp_path) as store:
        back = {t.id: t for t in store.trajectories()}
    assert back["old"].segments[0].temperature is None
    assert [s.temperature for s in back["proxy"].segments] == [0.5, None]


@pytest.mark.parametrize("temperature", [-0.5, float("nan"), float("inf")])
def test_a_segment_temperature_must_be_a_finite_number_at_least_zero(temperature):
    with pytest.raises(UserError, match="segment temperature"):
        Segment([1], [2], [-0.1], [0], temperature=temperature)


@given(st.lists(st.integers(-3, 3), max_size=50))
def test_version_runs_round_trip(versions):
    array = np.array(versions, dtype=np.int32)
    assert np.array_equal(expand_version_runs(version_runs(array), len(array)), array)


def test_late_rewards_bind_to_stored_records_and_unknown_ids_write_nothing(tmp_path):
    records = [make_trajectory(0, i) for i in range(3)]
    write_all(tmp_path, records)
    with TrajectoryShardWriter(tmp_path, "proxy") as writer:  # another process, later
        writer.set_reward(records[1].id, 0.25, step=0, source="judge", at=100.0)
        writer.set_reward(records[1].id, 0.75, step=0, source="judge", at=200.0)  # re-scored: replaces
        writer.set_reward(records[1].id, 1.0, step=1, source="env", at=150.0)
        with pytest.raises(UnknownTrajectoryError, match="no trajectory with id 'missing'"):
            writer.set_reward("missing", 1.0)
    with TrajectoryStore(tmp_path) as store:
        got = {t.id: t for t in store.trajectories()}
        n_reward_rows = sum(len(s.rewards) for s in store.shards.values())
    assert got[records[1].id].reward == pytest.approx(0.75 + 1.0)  # step 0 re-scored twice, step 1 added
    assert got[records[0].id].reward == records[0].reward
    assert n_reward_rows == 3 + 3  # the three written with the records, three late ones, none for "missing"
    assert same_record(got[records[1].id], records[1])  # tokens untouched


def test_rotation_manifest_and_restart_never_overwrite(tmp_path):
    write_all(tmp_path, [make_trajectory(1, i) for i in range(7)], max_shard_trajectories=3)
    write_all(tmp_path, [make_trajectory(2, i) for i in range(2)])  # a restarted writer, same id
    names = sorted(p.name for p in tmp_path.glob("*.h5"))
    assert names == [f"w0-{i:06d}.h5" for i in range(4)]
    manifest = json.loads((tmp_path / "manifest-w0.json").read_text())
    assert [e["trajectories"] for e in manifest["shards"]] == [3, 3, 1, 2]
    with TrajectoryStore(tmp_path) as store:
        assert len(store) == 9
    assert run_cli("shards", "verify", str(tmp_path)).returncode == 0


def test_two_writers_with_one_id_are_refused_not_clobbered(tmp_path):
    # two processes started together with the same id: both would write w0-000000.live.h5
    first, second = TrajectoryShardWriter(tmp_path, "w0"), TrajectoryShardWriter(tmp_path, "w0")
    first.append(make_trajectory(10, 0))
    with pytest.raises(UserError, match="is another writer using id 'w0' in this folder"):
        second.append(make_trajectory(10, 1))
    first.close()
    with TrajectoryStore(tmp_path) as store:
        assert [t.id for t in store.trajectories()] == ["s10-t0"]


def test_rotation_by_size(tmp_path):
    records = [make_trajectory(3, i) for i in range(6)]
    write_all(tmp_path, records, max_shard_bytes=1)  # every commit fills a shard
    assert len(list(tmp_path.glob("*.h5"))) == 6


def test_reader_tails_a_live_writer_in_another_process(tmp_path):
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.shard_processes", "write", str(tmp_path), "5", "60", "--sleep", "0.02"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline().startswith("committed")
        seen, counts = [], []
        with TrajectoryStore(tmp_path) as store:
            consumer = TrajectoryConsumer(store)
            while len(seen) < 60:
                seen += [t.id for t in consumer.take(min(7, 60 - len(seen)), timeout=10)]
                counts.append(len(seen))
    finally:
        writer.wait(timeout=30)
    assert seen == [f"s5-t{i}" for i in range(60)]  # oldest first, each once
    assert len(counts) > 3  # it really read while the writer was still writing


def test_consumer_waits_for_late_rewards_when_asked(tmp_path):
    records = [Trajectory([Segment([1], [2], [-0.5], [0])], id=f"r{i}") for i in range(3)]
    with TrajectoryShardWriter(tmp_path, "w0") as writer:
        for traj in records:
            writer.append(traj)
        with TrajectoryStore(tmp_path) as store:
            consumer = TrajectoryConsumer(store, require_reward=True)
            assert consumer.poll(10) == []
            writer.set_reward("r1", 1.0)
            assert [t.id for t in consumer.poll(10)] == ["r1"]
            writer.set_reward("r0", 0.0)
            writer.set_reward("r2", 0.0)
            assert [t.id for t in consumer.poll(10)] == ["r0", "r2"]
            assert consumer.cursor.state_dict()["shards"]["w0-000000"] == {"next": 3, "extra": []}


@given(st.lists(st.tuples(st.sampled_from(["s0", "s1"]), st.integers(0, 30)), max_size=60))
def test_cursor_state_round_trip_keeps_exactly_the_marked_rows(marks):
    cursor, marked = ConsumerCursor(), set()
    for stem, row in marks:
        if (stem, row) in marked:
            with pytest.raises(ValueError):
                cursor.mark(stem, row)
        else:
            cursor.mark(stem, row)
            marked.add((stem, row))
    restored = ConsumerCursor.from_state_dict(json.loads(json.dumps(cursor.state_dict())))
    assert len(restored) == len(marked)
    assert all(restored.is_consumed(s, r) == ((s, r) in marked) for s in ("s0", "s1") for r in range(32))


def test_damaged_bytes_are_reported_never_returned(tmp_path):
    write_all(tmp_path, [make_trajectory(4, i) for i in range(3)])
    shard = tmp_path / "w0-000000.h5"
    with h5py.File(shard, "r") as f:
        offset = f["tokens"].id.get_chunk_info(0).byte_offset
    with open(shard, "r+b") as fh:  # flip bytes inside the first record's tokens
        fh.seek(offset + 20)
        fh.write(b"\xff\xff\xff\xff")
    with TrajectoryStore(shard) as store, pytest.raises(ShardDamageError, match="row 0: record fails its checksum"):
        list(store.trajectories())
    result = run_cli("shards", "verify", str(tmp_path))
    assert result.returncode == 1
    assert "w0-000000.h5 row 0: record fails its checksum" in result.stdout
    assert "index_crc32" not in result.stdout  # the index itself is intact: only row 0's tokens changed


def test_verify_checks_finalised_shards_against_their_manifest(tmp_path):
    write_all(tmp_path, [make_trajectory(8, i) for i in range(6)], max_shard_trajectories=2)
    first = tmp_path / "w0-000000.h5"
    with h5py.File(first, "r") as f:
        offset = f["index"].id.get_chunk_info(0).byte_offset + INDEX_DTYPE.fields["eligible"][1]
    with open(first, "r+b") as fh:  # governance flag flipped behind the store's back
        fh.seek(offset)
        fh.write(b"\x00")
    (tmp_path / "w0-000001.h5").unlink()
    third = tmp_path / "w0-000002.h5"
    os.truncate(third, third.stat().st_size // 2)  # a copy cut short
    result = run_cli("shards", "verify", str(tmp_path))
    assert result.returncode == 1
    assert "DAMAGE: w0-000000.h5 row 0: index row fails its checksum" in result.stdout
    assert "DAMAGE: w0-000000.h5: index_crc32 is" in result.stdout
    assert "DAMAGE: w0-000001.h5: listed in manifest-w0.json but missing" in result.stdout
    assert f"DAMAGE: {third}: HDF5 cannot open it (Unable to synchronously open file (truncated file" in result.stdout
    inspect = run_cli("shards", "inspect", str(tmp_path))  # the summary of what is readable, and exit 1
    assert inspect.returncode == 1
    assert "1 shards (1 finalised, 0 live), 1 trajectories (+1 with a damaged index row)" in inspect.stdout
    assert f"{third}: HDF5 cannot open it" in inspect.stderr and inspect.stderr.count("\n") == 1


def test_inspect_and_export_of_a_test_run(tmp_path):
    records = [make_trajectory(6, i) for i in range(12)]
    write_all(tmp_path, records, max_shard_trajectories=5)
    inspect = run_cli("shards", "inspect", str(tmp_path))
    assert inspect.returncode == 0, inspect.stderr
    print(inspect.stdout)
    assert "3 shards (3 finalised, 0 live), 12 trajectories" in inspect.stdout
    assert "tenants: tenant0 4, tenant1 4, tenant2 4" in inspect.stdout
    assert "reward (12 scored, 0 awaiting a reward)" in inspect.stdout
    assert "torn tails: none" in inspect.stdout
    out = tmp_path / "export.jsonl"
    result = run_cli(
        "shards", "export", str(tmp_path), "--format", "jsonl", "--tenant", "tenant1", "--output", str(out)
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [t.id for t in records if t.tenant == "tenant1"]
    first = next(t for t in records if t.tenant == "tenant1")
    assert rows[0]["segments"][0]["output_ids"] == first.segments[0].output_ids.tolist()
    assert rows[0]["reward"] == first.reward


def test_bad_paths_and_files_are_one_line_errors(tmp_path):
    not_hdf5 = tmp_path / "notes.h5"
    not_hdf5.write_text("hello")
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = [1, 2]
    newer = tmp_path / "newer"
    write_all(newer, [make_trajectory(7, 0)])
    with h5py.File(newer / "w0-000000.h5", "r+") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        str(tmp_path / "missing"): "no such file or directory",
        str(not_hdf5): "is not an HDF5 file",
        str(foreign): "not an areal-hpc trajectory shard",
        str(newer): f"uses trajectory schema version {SCHEMA_VERSION + 1}; this areal-hpc reads version "
        f"{SCHEMA_VERSION} (upgrade areal-hpc to read it)",
        str(empty): "holds no trajectory shards",
    }
    for path, message in cases.items():
        for action in ("inspect", "verify", "export"):
            result = run_cli("shards", action, path)
            assert result.returncode == 2, (action, path, result.stderr)
            assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_malformed_records_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(UserError, match="output_logprobs has 1 entries; it needs one per output token"):
        Segment([1], [2, 3], [-0.1], [0, 0])
    with pytest.raises(UserError, match="trajectory id 'xxx"):
        Trajectory([Segment([1], [], [], [])], id="x" * 65)
    with pytest.raises(UserError, match="no segments"):
        Trajectory([])
    with TrajectoryShardWriter(tmp_path, "w0") as writer:
        writer.append(Trajectory([Segment([1], [2], [-0.1], [0])], id="once"))
        with pytest.raises(UserError, match="already written"):
            writer.append(Trajectory([Segment([1], [2], [-0.1], [0])], id="once"))
    with TrajectoryStore(tmp_path) as store:
        assert len(store) == 1
    with pytest.raises(UserError, match="writer id"):
        TrajectoryShardWriter(tmp_path, "bad/id")


def test_latest_reward_event_of_a_step_wins_whatever_the_write_order(tmp_path):
    traj = Trajectory([Segment([1], [2], [-0.1], [0])], rewards=[Reward(2.0, time=5.0), Reward(1.0, time=1.0)])
    assert traj.reward == 2.0
    write_all(tmp_path, [traj])
    with TrajectoryStore(tmp_path) as store:
        assert next(store.trajectories()).reward == 2.0


def test_damaged_ids_and_manifests_are_reported_not_tracebacks(tmp_path):
    write_all(tmp_path, [make_trajectory(12, i) for i in range(2)])
    shard = tmp_path / "w0-000000.h5"
    with h5py.File(shard, "r") as f:
        offset = f["index"].id.get_chunk_info(0).byte_offset  # row 0 starts with its id
    with open(shard, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\xff\xfe")  # not UTF-8 any more
    (tmp_path / "manifest-w1.json").write_text('{"shards": [{"name": "w1-000000.h5"}]}')
    result = run_cli("shards", "verify", str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert "w0-000000.h5 row 0: index row fails its checksum" in result.stdout
    assert "manifest-w1.json: an entry lacks" in result.stdout
    inspect = run_cli("shards", "inspect", str(tmp_path))
    assert inspect.returncode == 1 and "1 trajectories (+1 with a damaged index row)" in inspect.stdout
    assert "index rows 0 fail their checksum" in inspect.stderr and inspect.stderr.count("\n") == 1


def test_export_to_a_missing_folder_is_one_line(tmp_path):
    write_all(tmp_path / "shards", [make_trajectory(13, 0)])
    result = run_cli("shards", "export", str(tmp_path / "shards"), "--output", str(tmp_path / "no" / "out.jsonl"))
    assert result.returncode == 2 and "cannot write" in result.stderr and result.stderr.count("\n") == 1


def test_a_reward_for_a_record_another_writer_committed_later(tmp_path):
    proxy = TrajectoryShardWriter(tmp_path, "proxy")
    with pytest.raises(UnknownTrajectoryError):
        proxy.set_reward("late", 1.0)  # unknown yet
    write_all(tmp_path, [Trajectory([Segment([1], [2], [-0.1], [0])], id="late")])
    proxy.set_reward("late", 1.0)
    proxy.close()
    with TrajectoryStore(tmp_path) as store:
        assert next(store.trajectories()).reward == 1.0


def test_records_consumed_by_id_are_never_pending_again(tmp_path):
    with TrajectoryShardWriter(tmp_path, "w") as writer:
        for i in range(4):
            writer.append(make_trajectory(3, i))
    with TrajectoryStore(tmp_path) as store:
        consumer = TrajectoryConsumer(store)
        assert [t.id for t in consumer.take_ids(["s3-t2"])] == ["s3-t2"]
        consumer.mark_ids(["s3-t0"])  # consumed without being read back
        assert [t.id for t in consumer.pending()] == ["s3-t1", "s3-t3"]
        with pytest.raises(KeyError):
            consumer.mark_ids(["s3-t0"])
