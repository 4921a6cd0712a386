"""The trainer mesh: its groups are Megatron-core's own (``RankGenerator``, the code
``initialize_model_parallel`` builds its groups with) for every layout up to 32 ranks, the
DeviceMesh that real gloo ranks build has exactly those groups, and bad sizes are one clear line."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

from areal_hpc.config import ParallelConfig
from areal_hpc.errors import UserError
from areal_hpc.layout import ParallelDims
from areal_hpc.runtime.name_resolve import free_port
from tests.conftest import REPO

RankGenerator = pytest.importorskip("megatron.core.parallel_state").RankGenerator

DENSE_GROUPS = ("tp", "pp", "dp", "cp", "dp-cp", "tp-pp", "tp-cp", "tp-dp-cp", "tp-pp-dp-cp")
EXPERT_GROUPS = {"ep": "ep", "edp": "dp", "tp-ep": "tp-ep", "tp-ep-pp": "tp-ep-pp"}  # ours -> Megatron's name


def layouts(max_world: int = 32):
    for tp, pp, dp, cp in itertools.product(range(1, 5), range(1, 5), range(1, 9), range(1, 5)):
        if tp * pp * dp * cp <= max_world:
            for ep in (e for e in range(1, dp * cp + 1) if (dp * cp) % e == 0):
                yield ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)


def as_sets(groups) -> set[frozenset]:
    return {frozenset(g) for g in groups}


def test_groups_equal_megatron_rank_generator_for_every_layout_up_to_32_ranks():
    checked = 0
    for dims in layouts():
        dense = RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=dims.cp, order="tp-cp-ep-dp-pp")
        for name in DENSE_GROUPS:
            assert as_sets(dims.groups(name)) == as_sets(dense.get_ranks(name)), (dims, name)
        expert = RankGenerator(
            tp=dims.tp, ep=dims.ep, dp=dims.dp * dims.cp // dims.ep, pp=dims.pp, cp=1, order="tp-ep-dp-pp"
        )
        for ours, theirs in EXPERT_GROUPS.items():
            assert as_sets(dims.groups(ours)) == as_sets(expert.get_ranks(theirs)), (dims, ours)
        checked += 1
    assert checked > 500  # the whole space, not a sample


def test_every_rank_has_one_coordinate_per_dim_and_ranks_are_a_bijection():
    for dims in layouts(16):
        seen = {tuple(dims.coordinates(r)[k] for k in ("pp", "dp", "cp", "tp")) for r in range(dims.world_size)}
        assert len(seen) == dims.world_size


def test_sizes_from_config_fill_dp_and_accept_the_planners_allocation():
    assert ParallelDims.from_config(ParallelConfig(tp=2), 8) == ParallelDims(dp=4, tp=2)
    assert ParallelDims.from_config(ParallelConfig(allocation="megatron:d2p2t2"), 8) == ParallelDims(dp=2, tp=2, pp=2)
    assert ParallelDims.from_config(ParallelConfig(cp=2, ep=4), 8).dp == 4


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        (ParallelConfig(tp=3), 8, "tp=3 x pp=1 x cp=1 needs rl.trainer_processes to be a multiple of 3, got 8"),
        (ParallelConfig(dp=2, tp=2), 8, "need 4 processes, but 8 were started"),
        (ParallelConfig(ep=3), 4, "actor.parallel.ep=3 must divide dp x cp = 4"),
        (ParallelConfig(sequence_parallel=True), 2, "sequence_parallel=true needs tp > 1"),
        (ParallelConfig(allocation="megatron:8x1x1"), 8, "expected megatron:d<dp>p<pp>t<tp>"),
    ],
)
def test_bad_sizes_are_one_clear_line(parallel, world, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("+", r"\+")):
        ParallelDims.from_config(parallel, world)


def run_mesh_ranks(tmp_path, **sizes) -> list[dict]:
    world = sizes.get("dp", 1) * sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)
    port, out = str(free_port("127.0.0.1")), tmp_path / "mesh"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.mesh_ranks", str(out), *(f"{k}={v}" for k, v in sizes.items())],
            cwd=REPO,
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for r in range(world)
    ]
    try:
        assert [p.wait(timeout=120) for p in ranks] == [0] * world
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    return [json.loads((tmp_path / f"mesh.rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.distributed
@pytest.mark.parametrize("sizes", [dict(dp=2, tp=2), dict(pp=2, cp=2), dict(dp=2, cp=2, ep=2)])
def test_real_ranks_build_a_device_mesh_with_megatrons_groups(tmp_path, sizes):
    dims = ParallelDims(**sizes)
    reports = run_mesh_ranks(tmp_path, **sizes)
    expected = {"pp": "pp", "dp": "dp", "cp": "cp", "tp": "tp", "dp_cp": "dp-cp", "ep": "ep", "edp": "edp"}
    for rank, report in enumerate(reports):
        for sub_mesh, groups in expected.items():
            mine = next(g for g in dims.groups(groups) if rank in g)
            assert sorted(report["groups"][sub_mesh]) == sorted(mine), (rank, sub_mesh)
        assert report["data_rank"] == dims.coordinates(rank)["dp"]
    assert [r["leads_replica"] for r in reports].count(True) == dims.dp  # one rank reports for each replica
