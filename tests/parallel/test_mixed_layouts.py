"""Training groups of different shapes (``actor.parallel.groups``): every rank's group, coordinates and
batch share against an enumeration of the ranks in Megatron's order, and each layout or setting that is
not built for groups refused in one line (exit code 2 from the CLI, before anything starts)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.config import load_config
from areal_hpc.errors import UserError
from areal_hpc.layout import MixedLayout
from areal_hpc.resolve import Host, resolve
from tests.conftest import run_cli

shapes = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 3)), min_size=1, max_size=4)


def layout_of(groups: list) -> MixedLayout:
    world = sum(dp * tp * pp for dp, tp, pp in groups)
    cfg = load_config(
        None,
        [
            f"rl.trainer_processes={world}",
            "actor.parallel.groups=[" + ",".join(f"[{dp},{tp},{pp}]" for dp, tp, pp in groups) + "]",
        ],
    )
    return MixedLayout.from_config(cfg.actor.parallel, world)


@settings(max_examples=200, deadline=None)
@given(shapes)
def test_ranks_replicas_and_leaders_match_an_enumeration_in_megatron_order(groups):
    layout = layout_of(groups)
    expected, rank, replicas_before = {}, 0, 0
    for index, (dp, tp, pp) in enumerate(groups):
        for stage, replica, shard in itertools.product(range(pp), range(dp), range(tp)):  # pp slowest, tp fastest
            expected[rank] = (index, {"pp": stage, "dp": replica, "tp": shard}, replicas_before + replica)
            rank += 1
        replicas_before += dp
    assert layout.world_size == len(expected) and layout.replicas == replicas_before
    for rank, (index, coords, replica) in expected.items():
        assert layout.locate(rank)[0] == index
        assert {k: layout.coordinates(rank)[k] for k in coords} == coords
        assert layout.replica(rank) == replica
        assert layout.leads_replica(rank) == (coords["tp"] == coords["pp"] == 0)
    assert sorted(layout.replica(r) for r in expected if layout.leads_replica(r)) == list(range(replicas_before))
    stages = layout.stages()  # every rank in one stage, of one group and pipeline coordinate, led by dp = tp = 0
    assert sorted(r for ranks in stages for r in ranks) == list(expected)
    for ranks in stages:
        assert len({(expected[r][0], expected[r][1]["pp"]) for r in ranks}) == 1
        assert expected[ranks[0]][1]["dp"] == expected[ranks[0]][1]["tp"] == 0
    ends = [
        (first, last)
        for index, (dp, tp, pp) in enumerate(groups)
        if pp > 1  # slot by slot, group by group
        for first in expected
        if expected[first][0] == index and expected[first][1]["pp"] == 0
        for last in expected
        if expected[last][0] == index
        and expected[last][1]["pp"] == pp - 1
        and expected[last][1]["dp"] == expected[first][1]["dp"]
        and expected[last][1]["tp"] == expected[first][1]["tp"]
    ]
    assert [tuple(pair) for pair in layout.pipeline_ends()] == ends


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rl.trainer_processes=4", "actor.parallel.groups=[[1,2,1],[1,1,1]]"],
            "actor.parallel.groups [[1, 2, 1], [1, 1, 1]] hold 3 trainer ranks, but 4 were started",
        ),
        (["rl.trainer_processes=3", "actor.parallel.groups=[[1,2],[1,1,1]]"], "entry [1, 2] is not [dp, tp, pp]"),
        (["rl.trainer_processes=3", "actor.parallel.groups=[[1,2,1],[0,1,1]]"], "entry [0, 1, 1] has a size below 1"),
        (
            ["rl.trainer_processes=4", "actor.parallel.groups=[[1,2,1],[1,1,1]]", "actor.parallel.cp=2"],
            "actor.parallel.cp=2 is not built for training groups",
        ),
        (
            [
                "rl.trainer_processes=3",
                "actor.parallel.groups=[[1,2,1],[1,1,1]]",
                "actor.parallel.sequence_parallel=true",
            ],
            "needs tp > 1 in every group; group [1, 1, 1] has tp=1",
        ),
        (
            ["rl.trainer_processes=3", "actor.parallel.groups=[[1,2,1],[1,1,1]]", "actor.parallel.dp_weights=[1,1,1]"],
            "dp_weights=[1, 1, 1] must hold 2 positive numbers",
        ),
    ],
)
def test_a_layout_of_groups_that_cannot_run_is_one_line(overrides, message):
    cfg = load_config(None, overrides)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        MixedLayout.from_config(cfg.actor.parallel, cfg.rl.trainer_processes)


@pytest.mark.parametrize(
    "setting",
    [
        "actor.engine=megatron",
        "actor.adv_estimator=ppo",
        "actor.policy_loss=m2po",
        "actor.lora.rank=4",
        "actor.tree_training=dta",
    ],
)
def test_what_groups_do_not_build_is_refused_by_name(setting):
    cfg = load_config(None, ["rl.trainer_processes=3", "actor.parallel.groups=[[1,2,1],[1,1,1]]", setting])
    with pytest.raises(UserError, match=f"{setting} is not built for training groups of different shapes"):
        resolve(cfg, Host("cpu"))
    resolve(load_config(None, [setting]), Host("cpu"))  # one mesh: it trains


def test_the_cli_refuses_a_bad_group_layout_before_starting_anything(tmp_path):
    result = run_cli(
        "train",
        "--config",
        "configs/quickstart.yaml",
        f"cluster.fileroot={tmp_path}",
        "rl.trainer_processes=3",
        "actor.parallel.groups=[[1,2,1],[1,1,1]]",
        "actor.adv_estimator=ppo",
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "areal-hpc: error: actor.adv_estimator=ppo is not built for training groups of different shapes "
        "(actor.parallel.groups=[[1, 2, 1], [1, 1, 1]]); use an estimator without a critic, e.g. grpo, or one mesh"
    ]
    assert not any(tmp_path.iterdir())  # nothing written
