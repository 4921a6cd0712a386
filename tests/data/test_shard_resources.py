"""Resource hygiene of the shard store: files closed, late-reward look-ups incremental, id memory bounded."""

import tracemalloc

import h5py
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hpc.data.shards import (
    ShardDamageError,
    TrajectoryConsumer,
    TrajectoryShardWriter,
    TrajectoryStore,
    UnknownTrajectoryError,
)
from areal_hpc.data.shards import reader as reader_module
from areal_hpc.data.trajectory import Segment, Trajectory
from tests.data.test_shard_reports import truncate_to_half, write
from tests.shard_processes import make_trajectory


def open_hdf5_files() -> int:
    return len(h5py.h5f.get_obj_ids(types=h5py.h5f.OBJ_FILE))


def tiny(trajectory_id: str) -> Trajectory:
    return Trajectory([Segment([1], [2], [-0.5], [0])], id=trajectory_id)


@pytest.fixture
def opened(monkeypatch) -> list:
    """Every shard file the store code opens, in order."""
    paths, real = [], reader_module.open_shard

    def open_shard(path, *args):
        paths.append(path.name)
        return real(path, *args)

    monkeypatch.setattr(reader_module, "open_shard", open_shard)
    return paths


def test_a_store_that_fails_to_open_closes_what_it_opened(tmp_path):
    write(tmp_path, [make_trajectory(40, i) for i in range(4)], max_shard_trajectories=2)
    truncate_to_half(tmp_path / "w0-000001.h5")
    before = open_hdf5_files()
    with pytest.raises(ShardDamageError, match="w0-000001.h5: HDF5 cannot open it") as caught:
        TrajectoryStore(tmp_path)
    # w0-000000.h5 was open when w0-000001.h5 failed; the traceback (kept by the caller, here
    # ``caught``) holds the half-built store, so garbage collection does not close it
    assert open_hdf5_files() == before, caught


def test_finalised_shards_hold_no_file_open_and_the_consumer_closes_its_store(tmp_path):
    write(tmp_path, [make_trajectory(41, i) for i in range(6)], max_shard_trajectories=2)
    before = open_hdf5_files()
    live = TrajectoryShardWriter(tmp_path, "w1", fsync=False)
    live.append(make_trajectory(42, 0))
    with TrajectoryConsumer(TrajectoryStore(tmp_path)) as consumer:
        assert open_hdf5_files() == before + 2  # the live shard: its writer's handle and the store's
        assert len(consumer.take(7, timeout=5)) == 7  # reads reopen finalised shards, then close them
        assert open_hdf5_files() == before + 2
    assert open_hdf5_files() == before + 1
    live.close()
    assert open_hdf5_files() == before


def test_a_reward_for_an_unknown_id_reads_only_what_was_committed_since(tmp_path, opened):
    write(tmp_path, [make_trajectory(43, i) for i in range(6)], max_shard_trajectories=2)
    with TrajectoryShardWriter(tmp_path, "proxy", fsync=False) as proxy:
        with pytest.raises(UnknownTrajectoryError):
            proxy.set_reward("nobody", 1.0)
        assert sorted(opened) == ["w0-000000.h5", "w0-000001.h5", "w0-000002.h5"]
        with pytest.raises(UnknownTrajectoryError):
            proxy.set_reward("nobody", 1.0)
        proxy.set_reward("s43-t4", 1.0)  # read at the first miss: no file opened
        assert len(opened) == 3
        other = TrajectoryShardWriter(tmp_path, "w2", fsync=False)
        other.append(tiny("late"))  # committed in a live shard, after the first look-up
        proxy.set_reward("late", 0.5)
        assert opened[3:] == ["w2-000000.live.h5"]
        other.append(tiny("later"))
        proxy.set_reward("later", 0.5)  # the live shard stays open: read on from where it stopped
        other.close()  # ... and renamed: the open handle reads its last rows, then it is done
        with pytest.raises(UnknownTrajectoryError):
            proxy.set_reward("nobody", 1.0)
        assert opened[3:] == ["w2-000000.live.h5"]
    with TrajectoryStore(tmp_path) as store:
        rewards = {t.id: t.reward for t in store.trajectories()}
    assert (rewards["late"], rewards["later"], rewards["s43-t4"]) == (0.5, 0.5, 1.0)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.text("abc-_.0123456789", min_size=1, max_size=12), unique=True, max_size=40),
    probes=st.lists(st.text("abc-_.0123456789", min_size=1, max_size=12), max_size=20),
    per_shard=st.integers(1, 8),
    split=st.integers(0, 40),
)
def test_late_rewards_are_accepted_exactly_for_stored_ids(tmp_path_factory, ids, probes, per_shard, split):
    folder = tmp_path_factory.mktemp("ids")
    producer = TrajectoryShardWriter(folder, "w0", fsync=False, max_shard_trajectories=per_shard)
    rewarder = TrajectoryShardWriter(folder, "proxy", fsync=False)
    for i, trajectory_id in enumerate(ids):
        producer.append(tiny(trajectory_id))
        if i == split:  # some ids are committed after the rewarder first looked
            for probe in probes:
                stored = set(ids[: i + 1])
                if probe in stored:
                    rewarder.set_reward(probe, 1.0)
                else:
                    with pytest.raises(UnknownTrajectoryError):
                        rewarder.set_reward(probe, 1.0)
    for probe in probes + ids:
        if probe in ids:
            rewarder.set_reward(probe, 1.0)
        else:
            with pytest.raises(UnknownTrajectoryError):
                rewarder.set_reward(probe, 1.0)
    producer.close()
    rewarder.close()


def test_the_writer_keeps_a_few_bytes_per_id(tmp_path):
    n = 30_000
    with TrajectoryShardWriter(tmp_path, "w0", flush_every=5_000, fsync=False) as writer:
        for i in range(5_000):
            writer.append(tiny(f"warm-up-{i:08d}"))
        tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            writer.append(tiny(f"trajectory-{i:08d}"))
        grown = tracemalloc.get_traced_memory()[0] - start
        tracemalloc.stop()
    assert grown / n < 20, grown / n  # a Python set of the id strings takes ~90 bytes an id
