"""``resolve``: every ``auto`` value decided in one place, every rule between keys named and tested (each rule of
``RULES`` has a case below, or the last test fails), and a config nothing else can change."""

import dataclasses

import pytest

from areal_hpc import resolve as resolve_module
from areal_hpc.config import RunConfig, load_config
from areal_hpc.errors import UserError
from areal_hpc.resolve import RULES, Host, resolve

CPU, GPU = Host("cpu"), Host("cuda")

# rule -> cases (overrides, host, the values it decides)
DECIDES = {
    "device_auto": [
        ((), CPU, {"cluster.device": "cpu"}),
        ((), GPU, {"cluster.device": "cuda"}),
        (("cluster.device=cpu",), GPU, {}),  # asked for: kept
        ((), None, {}),  # off the nodes: each node decides
    ],
    "trainer_layout": [
        (("rl.trainer_processes=4", "actor.parallel.tp=2"), CPU, {"actor.parallel.dp": 2}),
        (("rl.trainer_processes=2", "actor.parallel.dp=2"), CPU, {}),
    ],
    "tree_training_auto": [
        (("actor.tree_training=auto",), CPU, {"actor.tree_training": "dta"}),
        (
            ("actor.tree_training=auto", "rl.trainer_processes=2", "actor.parallel.fsdp=true"),
            CPU,
            {"actor.tree_training": "dta"},
        ),
        (
            ("actor.tree_training=auto", "rl.trainer_processes=2", "actor.parallel.tp=2"),
            CPU,
            {"actor.tree_training": "off"},
        ),
        (("actor.tree_training=auto", "actor.engine=megatron"), CPU, {"actor.tree_training": "off"}),
        (("actor.tree_training=auto", "actor.importance_level=sequence"), CPU, {"actor.tree_training": "off"}),
        (("actor.tree_training=auto", "actor.lora.rank=4"), CPU, {"actor.tree_training": "off"}),
        (("actor.tree_training=auto", "actor.recompute=full"), CPU, {"actor.tree_training": "off"}),
    ],
    "rank0_training_auto": [
        ((), CPU, {"rl.rank0_training": "child"}),
        ((), GPU, {"rl.rank0_training": "thread"}),  # the update waits on the device, not on the interpreter lock
        (("rl.weight_sync=distributed",), CPU, {"rl.rank0_training": "thread"}),
        (("rl.rank0_training=child",), GPU, {}),  # asked for: honoured
        ((), None, {}),  # follows the node's device
    ],
}

# rule -> cases (overrides, a fragment of its one line)
REFUSES = {
    "trainer_layout": [
        (("rl.trainer_processes=3", "actor.parallel.tp=2"), "needs rl.trainer_processes to be a multiple of 2"),
        (("rl.trainer_processes=3", "actor.parallel.groups=[[1,1,1]]"), "hold 1 trainer ranks, but 3 were started"),
    ],
    "trust_region_needs_decoupled_loss": [
        (("actor.policy_loss=m2po", "actor.decoupled_loss=false"), "actor.policy_loss=m2po bounds log"),
    ],
    "sequence_ratio_without_context_parallel": [
        (("actor.importance_level=sequence", "rl.trainer_processes=2", "actor.parallel.cp=2"), "use cp=1 with GSPO"),
    ],
    "tree_training_dta": [
        (("actor.tree_training=dta", "actor.engine=megatron"), "actor.tree_training=dta needs actor.engine=torch"),
        (("actor.tree_training=dta", "actor.importance_level=sequence"), "importance_level=sequence; set"),
        (("actor.tree_training=dta", "actor.tree_cost=[0,0,0,0,0]"), "actor.tree_cost=[0, 0, 0, 0, 0] must hold"),
    ],
    "training_groups": [
        (("actor.adv_estimator=ppo",), "actor.adv_estimator=ppo is not built for training groups"),
        (("actor.engine=megatron",), "actor.engine=megatron is not built for training groups"),
        (("actor.lora.rank=4",), "actor.lora.rank=4 is not built for training groups"),
    ],
    "lora_engine": [
        (("actor.lora.rank=4", "actor.engine=megatron"), "needs actor.engine=torch, got actor.engine=megatron")
    ],
    "lora_layout": [
        (("actor.lora.rank=4", "actor.tree_training=dta"), "does not train with actor.tree_training=dta"),
        (("actor.lora.rank=4", "rl.trainer_processes=2", "actor.parallel.tp=2"), "actor.parallel.tp=2 (tensor"),
        (("actor.lora.rank=4", "rl.trainer_processes=2", "actor.parallel.cp=2"), "actor.parallel.cp=2 (context"),
    ],
    "rank0_training_child_needs_disk_sync": [
        (
            ("rl.rank0_training=child", "rl.weight_sync=distributed"),
            "rl.rank0_training=child needs rl.weight_sync=disk",
        ),
    ],
    "sft_stop_needs_evaluations": [
        (("sft.stop_at_accuracy=0.5", "sft.eval_every_steps=0"), "'sft.stop_at_accuracy' = 0.5 needs evaluations"),
    ],
}
GROUPS = ("rl.trainer_processes=3", "actor.parallel.groups=[[1,2,1],[1,1,1]]")


def decided_by(run, rule: str) -> dict:
    return {d.key: d.value for d in run.decisions if d.rule == rule}


@pytest.mark.parametrize(
    "rule, overrides, host, decided", [(rule, *case) for rule, cases in DECIDES.items() for case in cases]
)
def test_a_rule_decides_its_values(rule, overrides, host, decided):
    assert decided_by(resolve(load_config(None, list(overrides)), host), rule) == decided


@pytest.mark.parametrize("rule, overrides, words", [(rule, *case) for rule, cases in REFUSES.items() for case in cases])
def test_a_rule_refuses_in_one_line(rule, overrides, words):
    overrides = [*GROUPS, *overrides] if rule == "training_groups" else list(overrides)
    with pytest.raises(UserError) as refused:
        resolve(load_config(None, overrides), CPU)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_every_rule_has_a_test():
    names = [rule.name for rule in RULES]
    assert len(set(names)) == len(names)
    assert set(names) == {*DECIDES, *REFUSES}


def auto_keys(section: object, prefix: str = "") -> list[str]:
    keys = []
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if dataclasses.is_dataclass(value):
            keys += auto_keys(value, f"{prefix}{field.name}.")
        elif "auto" in (field.metadata.get("choices") or []):
            keys.append(prefix + field.name)
    return keys


@pytest.mark.parametrize("host", [CPU, GPU])
def test_on_a_node_no_auto_value_is_left(host):
    """Every key that offers auto (a new one included) is decided by a rule where the processes run."""
    keys = auto_keys(RunConfig())
    assert {"cluster.device", "actor.tree_training", "rl.rank0_training"} <= set(keys)
    run = resolve(load_config(None, [f"{key}=auto" for key in keys]), host)
    assert {d.key for d in run.decisions} >= set(keys)
    assert run.per_node == ()


def test_off_the_nodes_only_what_a_node_shows_is_left_to_it():
    run = resolve(load_config(None, ["actor.tree_training=auto"]), None)
    assert run.per_node == ("cluster.device", "rl.rank0_training")
    assert run.cfg.actor.tree_training == "dta"
    on_node = resolve(run.cfg, CPU)  # what a Slurm task does with the config the submit wrote
    assert on_node.cfg == resolve(load_config(None, ["actor.tree_training=auto"]), CPU).cfg
    assert resolve(on_node.cfg, CPU).cfg == on_node.cfg  # settled once, it stays as it is


def test_resolve_returns_a_new_config_and_the_layout():
    cfg = load_config(None, ["rl.trainer_processes=2", "actor.tree_training=auto"])
    run = resolve(cfg, CPU)
    assert cfg.actor.tree_training == "auto" and cfg.cluster.device == "auto" and cfg.actor.parallel.dp == 0
    assert (run.cfg.actor.tree_training, run.cfg.cluster.device, run.cfg.actor.parallel.dp) == ("dta", "cpu", 2)
    assert [g.dp for g in run.layout.groups] == [2]


def sections(section: object) -> list[object]:
    found = [section]
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if dataclasses.is_dataclass(value):
            found += sections(value)
    return found


def test_the_config_is_frozen_so_nothing_but_resolve_decides_a_value():
    """A change anywhere else (the old in-place tree_training=auto, say) raises where it is made."""
    cfg = load_config(None)
    assert all(type(s).__dataclass_params__.frozen for s in sections(cfg))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.tree_training = "dta"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cluster.device = "cpu"


def test_the_probe_reads_the_device_files_and_what_the_process_may_see(monkeypatch):
    files = {"/dev/nvidia[0-9]*": ["/dev/nvidia0"]}
    monkeypatch.setattr(resolve_module.glob, "glob", lambda pattern: files.get(pattern, []))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    assert Host.probe() == GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert Host.probe() == CPU
    files = {"/dev/davinci[0-9]*": ["/dev/davinci0"]}
    assert Host.probe() == Host("npu")
    files = {}
    assert Host.probe() == CPU
