"""One place that settles a run before anything starts: ``resolve(cfg, host)`` decides every ``auto`` value
and runs every rule between keys, in one list (``RULES``), once, and returns the ``ResolvedRun`` that the
launchers, ``slurm-task``, the trainer and SFT read.

    run = resolve(load_config(path, overrides), Host.probe())   # on the node the processes run on
    run.cfg.actor.tree_training                                  # "dta" or "off", never "auto"
    run.layout                                                   # the trainer ranks' meshes

``load_config`` only loads and type-checks each key; a rule is a name and a function that either decides
values (``{"actor.tree_training": "dta"}``) or raises one ``UserError`` line (what, the value, what would be
valid). The config is frozen: ``resolve`` returns a new one with the decided values in place, and nothing
else can change it.

Some values depend on the node a process runs on: ``cluster.device=auto`` is the accelerator that node
shows, and ``rl.rank0_training=auto`` follows from it. A login node submitting to GPU nodes shows none, so
it resolves with ``host=None``: those keys stay ``auto`` (``ResolvedRun.per_node`` names them) and each
process decides them where it runs, from ``Host.probe()``. Every rule that does not depend on the node runs
either way, so the submit refuses what the nodes would.

Checks that need more than the config stay beside their inputs: the data, user code, the teacher's server and
LoRA's target modules (``train.task_setup.check_inputs``, which the launchers call next), the engines'
divisibility by the model's heads and layers (when they build), the live cluster (``launch.submit``).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from areal_hpc import builtins
from areal_hpc.algo.tree_balance import check_cost
from areal_hpc.config import RunConfig
from areal_hpc.errors import UserError
from areal_hpc.layout import MixedLayout

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Section = TypeVar("Section", bound="DataclassInstance")
Decided = dict[str, Any]  # config key -> the value a rule decided for it

# (kind, its device files, the variable that narrows what a process sees), in the order ``auto`` prefers them
ACCELERATORS = (
    ("cuda", "/dev/nvidia[0-9]*", "CUDA_VISIBLE_DEVICES"),
    ("npu", "/dev/davinci[0-9]*", "ASCEND_RT_VISIBLE_DEVICES"),
)


@dataclass(frozen=True)
class Host:
    """The node a process runs on, as far as a run's ``auto`` values depend on it: the accelerator it shows
    (cuda, npu or cpu)."""

    accelerator: str

    @classmethod
    def probe(cls) -> Host:
        """This node, read without importing torch or touching a device (CUDA does not survive a fork after
        that): the first kind whose device files exist and that the visible-devices variable, where set,
        does not hide."""
        for kind, devices, variable in ACCELERATORS:
            if glob.glob(devices) and os.environ.get(variable, "0").strip() not in ("", "-1"):
                return cls(kind)
        return cls("cpu")


@dataclass(frozen=True)
class Rule:
    """One named rule: ``apply(cfg, host)`` returns the values it decides ({} for a check), or raises."""

    name: str
    apply: Callable[[RunConfig, Host | None], Decided]


@dataclass(frozen=True)
class Decision:
    rule: str
    key: str
    value: Any


@dataclass(frozen=True)
class ResolvedRun:
    """A settled run: the config with every decided value in place, the trainer ranks' layout, what each
    rule decided, and the host it was settled for (None: off the nodes, see ``per_node``)."""

    cfg: RunConfig
    layout: MixedLayout
    decisions: tuple[Decision, ...]
    host: Host | None

    @property
    def per_node(self) -> tuple[str, ...]:
        """The keys left ``auto`` for each node to decide (resolved without a host)."""
        return tuple(key for key in PER_NODE if _get(self.cfg, key) == "auto")


def resolve(cfg: RunConfig, host: Host | None) -> ResolvedRun:
    """Run ``RULES`` in order on ``cfg`` (each sees what the earlier ones decided) for the node ``host``
    (``Host.probe()`` where the run's processes run; None on a login node). ``cfg`` itself is not changed."""
    decisions: list[Decision] = []
    for rule in RULES:
        for key, value in rule.apply(cfg, host).items():
            cfg = _with(cfg, key, value)
            decisions.append(Decision(rule.name, key, value))
    return ResolvedRun(cfg, _layout(cfg), tuple(decisions), host)


def _with(section: Section, key: str, value: Any) -> Section:
    """``section`` (a frozen config dataclass) with the dotted ``key`` set to ``value``."""
    head, _, rest = key.partition(".")
    return dataclasses.replace(section, **{head: _with(getattr(section, head), rest, value) if rest else value})


def _get(cfg: RunConfig, key: str) -> Any:
    value: Any = cfg
    for name in key.split("."):
        value = getattr(value, name)
    return value


def _layout(cfg: RunConfig) -> MixedLayout:
    return MixedLayout.from_config(cfg.actor.parallel, cfg.rl.trainer_processes)


def device_auto(cfg: RunConfig, host: Host | None) -> Decided:
    """``cluster.device=auto``: the accelerator the node shows (per node)."""
    return {"cluster.device": host.accelerator} if cfg.cluster.device == "auto" and host is not None else {}


def trainer_layout(cfg: RunConfig, host: Host | None) -> Decided:
    """The meshes fit ``rl.trainer_processes``; ``actor.parallel.dp=0`` becomes what the other sizes leave."""
    layout, parallel = _layout(cfg), cfg.actor.parallel
    return {"actor.parallel.dp": layout.groups[0].dp} if parallel.dp == 0 and not parallel.groups else {}


def trust_region_needs_decoupled_loss(cfg: RunConfig, host: Host | None) -> Decided:
    policy_loss = cfg.actor.policy_loss
    if builtins.load("policy_loss", policy_loss).trust_region and not cfg.actor.decoupled_loss:
        raise UserError(
            f"actor.policy_loss={policy_loss} bounds log(π_prox/π_behav), which actor.decoupled_loss=false "
            "does not use; set actor.decoupled_loss=true, or a policy loss without a trust region"
        )
    return {}


def sequence_ratio_without_context_parallel(cfg: RunConfig, host: Host | None) -> Decided:
    cp = cfg.actor.parallel.cp
    if cfg.actor.importance_level == "sequence" and cp > 1:
        raise UserError(
            f"actor.importance_level=sequence (GSPO) takes each sequence's ratio over all its tokens, "
            f"but actor.parallel.cp={cp} deals them over several ranks; use cp=1 with GSPO"
        )
    return {}


def tree_training_auto(cfg: RunConfig, host: Host | None) -> Decided:
    """``actor.tree_training=auto``: dta where tree training runs (what the dta rule and the engines accept:
    an engine that trains trees, a token-level loss, no LoRA, no recomputation, one process or data-parallel
    replicas of one shape), else off."""
    actor = cfg.actor
    if actor.tree_training != "auto":
        return {}
    dims = _layout(cfg).groups[0]
    fits = (
        dims.world_size == dims.dp
        and dims.ep == 1
        and not actor.parallel.groups
        and actor.importance_level == "token"
        and not actor.lora.rank
        and actor.recompute == "none"
        and builtins.engine_supports(actor.engine, "supports_tree_training")
        and builtins.tree_training_obstacle(model_config(cfg)) is None
    )
    return {"actor.tree_training": "dta" if fits else "off"}


def model_config(cfg: RunConfig) -> dict[str, Any]:
    """The run's model's config.json (``model.path``), or its preset's family; empty where it cannot be read
    yet (the model is checked where it is loaded)."""
    if not cfg.model.path:
        return {"model_type": builtins.MODEL_PRESETS.get(cfg.model.preset, "qwen2")}
    try:
        with open(os.path.join(cfg.model.path, "config.json")) as file:
            loaded = json.load(file)
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def tree_training_dta(cfg: RunConfig, host: Host | None) -> Decided:
    """dta needs an engine that trains trees, a loss summed per token, and a valid ``actor.tree_cost``."""
    actor = cfg.actor
    if actor.tree_training != "dta":
        return {}
    if not builtins.engine_supports(actor.engine, "supports_tree_training") or actor.importance_level != "token":
        raise UserError(
            f"actor.tree_training=dta needs actor.engine=torch and actor.importance_level=token (a loss "
            f"summed per token), got engine={actor.engine}, importance_level="
            f"{actor.importance_level}; set actor.tree_training=off"
        )
    builtins.check_tree_training(model_config(cfg))
    check_cost(actor.tree_cost)
    return {}


def training_groups(cfg: RunConfig, host: Host | None) -> Decided:
    """With ``actor.parallel.groups``: an engine that sums the groups' gradients (``supports_training_groups``);
    what else needs collectives over every replica (a critic's whitening, M2PO's batch-wide bound) or a
    gradient path of its own (LoRA, tree training) is not built for them."""
    actor = cfg.actor
    if not actor.parallel.groups:
        return {}
    loss = builtins.load("policy_loss", actor.policy_loss)
    unbuilt = [
        ("actor.engine", actor.engine, not builtins.engine_supports(actor.engine, "supports_training_groups"), "torch"),
        (
            "actor.adv_estimator",
            actor.adv_estimator,
            builtins.uses_critic(actor.adv_estimator),
            "an estimator without a critic, e.g. grpo",
        ),
        ("actor.policy_loss", actor.policy_loss, loss.trust_region, "a policy loss without a trust region"),
        ("actor.lora.rank", actor.lora.rank, actor.lora.rank != 0, "0"),
        ("actor.tree_training", actor.tree_training, actor.tree_training == "dta", "off or auto"),
    ]
    for name, value, refused, instead in unbuilt:
        if refused:
            raise UserError(
                f"{name}={value} is not built for training groups of different shapes "
                f"(actor.parallel.groups={list(actor.parallel.groups)}); use {instead}, or one mesh"
            )
    return {}


def lora_engine(cfg: RunConfig, host: Host | None) -> Decided:
    """LoRA needs an engine whose class says ``supports_lora``."""
    engine = cfg.actor.engine
    if cfg.actor.lora.rank and not builtins.engine_supports(engine, "supports_lora"):
        raise UserError(
            f"actor.lora.rank > 0 needs actor.engine=torch, got actor.engine={engine}; "
            "set actor.engine=torch or actor.lora.rank=0"
        )
    return {}


LORA_UNSUPPORTED = {"tp": "tensor", "pp": "pipeline", "cp": "context", "ep": "expert"}


def lora_layout(cfg: RunConfig, host: Host | None) -> Decided:
    """LoRA trains on one process or data-parallel ranks, without tree training."""
    actor = cfg.actor
    if not actor.lora.rank or actor.parallel.groups:  # groups: the training_groups rule refuses LoRA
        return {}
    if actor.tree_training == "dta":
        raise UserError(
            f"actor.lora.rank > 0 does not train with actor.tree_training={actor.tree_training}; "
            "set actor.tree_training=off or actor.lora.rank=0"
        )
    dims = _layout(cfg).groups[0]
    for dim, kind in LORA_UNSUPPORTED.items():
        size = getattr(dims, dim)
        if size > 1:
            raise UserError(
                f"actor.lora.rank > 0 trains on one process or data-parallel ranks only "
                f"(actor.parallel.dp, fsdp), not actor.parallel.{dim}={size} ({kind} parallelism); "
                f"set {dim}=1 or actor.lora.rank=0"
            )
    return {}


def rank0_training_child_needs_disk_sync(cfg: RunConfig, host: Host | None) -> Decided:
    sync = cfg.rl.weight_sync
    if cfg.rl.rank0_training == "child" and sync != "disk":
        raise UserError(
            f"rl.rank0_training=child needs rl.weight_sync=disk (the servers read the folder the "
            f"training process writes), got rl.weight_sync={sync}; use rl.rank0_training=auto or thread"
        )
    return {}


def rank0_training_auto(cfg: RunConfig, host: Host | None) -> Decided:
    """``rl.rank0_training=auto`` (per node): child with the disk sync on a CPU; a thread on an accelerator,
    where the update waits on the device rather than on the interpreter lock, or with the distributed sync,
    which broadcasts from the training process's own tensors."""
    if cfg.rl.rank0_training != "auto" or cfg.cluster.device == "auto":
        return {}
    child = cfg.rl.weight_sync == "disk" and cfg.cluster.device == "cpu"
    return {"rl.rank0_training": "child" if child else "thread"}


def sft_stop_needs_evaluations(cfg: RunConfig, host: Host | None) -> Decided:
    if cfg.sft.stop_at_accuracy and not cfg.sft.eval_every_steps:
        raise UserError(
            f"config key 'sft.stop_at_accuracy' = {cfg.sft.stop_at_accuracy:g} needs evaluations to "
            "check it: set sft.eval_every_steps (e.g. 25)"
        )
    return {}


RULES = tuple(
    Rule(fn.__name__, fn)
    for fn in (
        device_auto,
        trainer_layout,
        trust_region_needs_decoupled_loss,
        sequence_ratio_without_context_parallel,
        tree_training_auto,
        tree_training_dta,
        training_groups,
        lora_engine,
        lora_layout,
        rank0_training_child_needs_disk_sync,
        rank0_training_auto,
        sft_stop_needs_evaluations,
    )
)
PER_NODE = ("cluster.device", "rl.rank0_training")  # the auto values a node decides for itself
