"""Every extension point and its built-ins, listed once, and the one loader of the code they name.

An extension point is a config key that names code: a task, a workflow, a training engine, a policy
loss, an advantage estimator, a reward. Its value is a built-in's name from the table below, or the
user's own ``'package.module:Name'`` / ``'path/to/file.py:Name'``: ``load(point, value)`` resolves both
the same way. ``load_object`` imports a spec once per process and checks it is callable, or raises one
``UserError`` line naming the config key, the value and what would be valid; a file is loaded under a
module name derived from its absolute path, so the same file gives the same objects however often it is
named. The config's validation, the CLI's choices and the docs'
reference tables (``docs/gen_reference.py``) read this table; ``tests/core/test_builtins.py`` fails when a
built-in's name is compared or listed anywhere else in the package.

The table holds strings only (no imports), so it sits on the bottom floors and loads nothing until a
run asks for a point's object.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from areal_hpc.errors import UserError

FORMS = "'package.module:name' or 'path/to/file.py:name'"


@dataclass(frozen=True)
class ExtensionPoint:
    """One config key that names code: its built-ins (name -> 'module:name') and what a user's own must be."""

    key: str
    contract: str
    builtins: dict[str, str]
    default: str
    keywords: dict[str, str] = field(default_factory=dict)  # names that are not code (e.g. task=custom): meaning

    @property
    def names(self) -> list[str]:
        """Every name the key accepts besides a spec: the built-ins, then the keywords."""
        return [*self.builtins, *self.keywords]


POINTS: dict[str, ExtensionPoint] = {
    "task": ExtensionPoint(
        key="dataset.task",
        contract="make_task(cfg: DatasetConfig) -> Task (train and held-out examples with their reward)",
        builtins={
            "arithmetic": "areal_hpc.data.arithmetic:make_task",
            "countdown": "areal_hpc.data.countdown:make_task",
            "gsm8k": "areal_hpc.data.gsm8k:make_task",
            "calculator": "areal_hpc.data.calculator:make_task",
        },
        default="arithmetic",
        keywords={"custom": "your data from dataset.path, scored by reward.fn or reward.model"},
    ),
    "workflow": ExtensionPoint(
        key="rollout.workflow",
        contract="a class built with rollout.workflow_args, with `async def arun_episode(self, engine, example)`",
        builtins={
            "rlvr": "areal_hpc.agents.rlvr:RLVRWorkflow",
            "multi_turn_math": "areal_hpc.agents.multi_turn_math:MultiTurnMathWorkflow",
            "calculator": "areal_hpc.agents.calculator:CalculatorWorkflow",
            "python_tool": "areal_hpc.agents.python_tool:PythonToolWorkflow",
            "search": "areal_hpc.agents.search.workflow:SearchAgentWorkflow",
            "agents_sdk": "areal_hpc.agents.sdk_agent:AgentsSDKWorkflow",
            "agent_program": "areal_hpc.agents.agent_program:AgentProgramWorkflow",
        },
        default="rlvr",
        keywords={"": "rlvr (configs saved before rlvr was the default)"},
    ),
    "train_engine": ExtensionPoint(
        key="actor.engine",
        contract="a subclass of areal_hpc.engines.base.TrainEngine (e.g. of TorchTrainEngine) with the classmethod "
        "`build(role, cfg, mesh, path, tokenizer)` (roles: engines.base.ROLES) and its capabilities as class "
        "attributes (supports_tree_training, supports_lora, supports_training_groups)",
        builtins={
            "torch": "areal_hpc.engines.torch.engine:TorchTrainEngine",
            "megatron": "areal_hpc.engines.megatron.engine:MegatronTrainEngine",
        },
        default="torch",
    ),
    "policy_loss": ExtensionPoint(
        key="actor.policy_loss",
        contract="a PolicyLoss (areal_hpc.algo.policy_losses): `surrogate(ratio, advantages, cfg)` and its "
        "`trust_region` flag",
        builtins={
            "ppo": "areal_hpc.algo.policy_losses:CLIPPED",
            "sapo": "areal_hpc.algo.policy_losses:SAPO",
            "m2po": "areal_hpc.algo.policy_losses:M2PO",
        },
        default="ppo",
    ),
    "advantage_estimator": ExtensionPoint(
        key="actor.adv_estimator",
        contract="estimator(rewards: [N] float64, group_ids: [N], eps) -> [N] advantages, one per sequence",
        builtins={
            "grpo": "areal_hpc.algo.advantages:grpo",
            "dr_grpo": "areal_hpc.algo.advantages:dr_grpo",
            "lite_ppo": "areal_hpc.algo.advantages:lite_ppo",
            "rloo": "areal_hpc.algo.advantages:rloo",
            "reinforce_pp": "areal_hpc.algo.advantages:reinforce_pp",
            "reinforce_pp_baseline": "areal_hpc.algo.advantages:reinforce_pp_baseline",
        },
        default="grpo",
        keywords={"ppo": "PPO's critic and GAE (trains a value model beside the policy)"},
    ),
    "reward": ExtensionPoint(
        key="reward.fn",
        contract="fn(prompt, completion, prompt_ids, completion_ids, **fields) -> number or {'reward': number, ...} "
        "(sync or async)",
        builtins={
            "math_verify": "areal_hpc.reward.math_answer:math_verify_reward",
            "exact_match": "areal_hpc.reward.match:exact_match_reward",
            "regex": "areal_hpc.reward.match:regex_reward",
            "code_tests": "areal_hpc.reward.code_tests:code_reward",
        },
        default="",
        keywords={"": "the task's own reward"},
    ),
}


def describe(point: str) -> str:
    """What ``point``'s key accepts, for an error line or a help text."""
    names = ", ".join(n or "''" for n in POINTS[point].names)
    return f"a built-in ({names}) or your own {FORMS}"


def check(point: str, value: str) -> None:
    """Raise one ``UserError`` line when ``value`` is neither a name ``point`` accepts nor a well-formed spec."""
    entry = POINTS[point]
    if value in entry.names:
        return
    if not isinstance(value, str) or ":" not in value:
        raise UserError(f"config key '{entry.key}': {value!r} is not {describe(point)}")
    split_spec(value, entry.key)


def spec_of(point: str, value: str) -> str:
    """The 'module:name' spec ``value`` stands for at ``point`` (a built-in's name, or the user's spec as given)."""
    check(point, value)
    entry = POINTS[point]
    if value in entry.keywords:
        raise UserError(f"config key '{entry.key}': {value!r} names no code ({entry.keywords[value]})")
    return entry.builtins.get(value, value)


def load(point: str, value: str) -> Any:
    """The object ``value`` names at ``point``: a built-in's or the user's own, imported once per process."""
    return load_object(spec_of(point, value), POINTS[point].key)


# What the built-in engines can do (their TrainEngine class attributes), so that resolving a run imports no
# torch: every Slurm task, rank and server resolves at start-up. A user's engine is asked through its class;
# tests/core/test_builtins.py holds this table to the built-in classes.
ENGINE_CAPABILITIES = {
    "torch": {"supports_tree_training": True, "supports_lora": True, "supports_training_groups": True},
    "megatron": {"supports_tree_training": False, "supports_lora": False, "supports_training_groups": False},
}


def engine_supports(engine: str, capability: str) -> bool:
    """Whether ``actor.engine`` has ``capability`` (e.g. ``supports_lora``): from the table for a built-in, from
    its class for the user's own."""
    if engine in ENGINE_CAPABILITIES:
        return ENGINE_CAPABILITIES[engine][capability]
    return bool(getattr(load("train_engine", engine), capability))


# Model families (a checkpoint's config.json ``model_type``) and the paths of this project that take each;
# the torch engine's own forward takes any transformers causal LM. A path refuses another family by name.
FAMILY_PATHS = {
    "qwen2": ("embedded decoder", "Megatron engine", "segment forward", "tree training"),
    "qwen3": ("embedded decoder", "Megatron engine", "segment forward", "tree training"),
    "qwen3_moe": ("embedded decoder", "Megatron engine", "tree training"),
    "llama": ("embedded decoder", "Megatron engine", "tree training"),
    "gemma3_text": ("embedded decoder", "Megatron engine"),
}

# The models ``model.preset`` and ``areal-hpc init-model --preset`` build, and the family of each; their shapes
# are ``models.tiny.PRESETS`` and ``models.replicas.REPLICAS`` (tests/models/test_tiny.py holds them to this).
MODEL_PRESETS = {
    "tiny": "qwen2",
    "small": "qwen2",
    "tiny-moe": "qwen3_moe",
    "qwen3-replica": "qwen3",
    "llama3-replica": "llama",
    "gemma3-replica": "gemma3_text",
}


def family_supports(model_type: str, path: str) -> bool:
    """Whether ``path`` (e.g. "embedded decoder") takes models of family ``model_type``."""
    return path in FAMILY_PATHS.get(model_type, ())


def tree_training_obstacle(model_config: dict[str, Any]) -> str | None:
    """Why a model with this config.json cannot take tree training (its family, or sliding-window layers:
    a prefix's cached keys would be cut at the window), or None when it can."""
    family = model_config.get("model_type", "qwen2")
    if not family_supports(family, "tree training"):
        return f"the model's family {family!r}"
    if model_config.get("use_sliding_window") or "sliding_attention" in (model_config.get("layer_types") or ()):
        return "the model's sliding-window layers"
    return None


def check_tree_training(model_config: dict[str, Any]) -> None:
    """One ``UserError`` line where ``actor.tree_training=dta`` cannot take this model."""
    obstacle = tree_training_obstacle(model_config)
    if obstacle:
        raise UserError(f"actor.tree_training=dta cannot train {obstacle} as a tree; set actor.tree_training=off")


def check_family(model_type: str, path: str, instead: str) -> None:
    """One ``UserError`` line when ``path`` does not take ``model_type``; ``instead``: what would."""
    if not family_supports(model_type, path):
        takes = ", ".join(family for family, paths in FAMILY_PATHS.items() if path in paths)
        raise UserError(f"the {path} takes {takes} models, not {model_type!r}: {instead}")


def uses_critic(adv_estimator: str) -> bool:
    """Whether ``actor.adv_estimator`` is PPO's: GAE over a critic trained beside the policy."""
    return adv_estimator == "ppo"


def is_megatron_engine(engine: str) -> bool:
    """Whether ``actor.engine`` is the built-in Megatron engine: the torch-free memory estimator models its
    precision and vocabulary-parallel logits (any other engine is estimated as the torch one)."""
    return engine == "megatron"


def is_custom_task(task: str) -> bool:
    """Whether ``dataset.task`` is the user's data from ``dataset.path`` rather than code that makes a task."""
    return task == "custom"


def split_spec(spec: str, key: str) -> tuple[str, str]:
    source, sep, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not source or not name.isidentifier():
        raise UserError(f"config key '{key}': {spec!r} is not {FORMS}")
    return source, name


def load_object(spec: str, key: str) -> Any:
    """The callable ``spec`` names (``key``: the config key, for the error line)."""
    source, name = split_spec(spec, key)
    module = _module_of_file(source, key) if source.endswith(".py") else _import(source, key)
    obj = getattr(module, name, None)
    if obj is None:
        raise UserError(
            f"config key '{key}': {spec!r}: {module.__name__} has no {name!r} "
            f"(it defines {', '.join(n for n in dir(module) if not n.startswith('_'))[:300]})"
        )
    if not callable(obj):
        raise UserError(f"config key '{key}': {spec!r} is a {type(obj).__name__}, not a function or class")
    return obj


def _import(dotted: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(dotted)
    except ImportError as exc:
        raise UserError(f"config key '{key}': cannot import {dotted!r}: {exc} (install it, or give {FORMS})") from None


def _module_of_file(path: str, key: str) -> ModuleType:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise UserError(f"config key '{key}': no file {str(file)!r} (a Python file, relative to the working folder)")
    name = f"areal_user_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise UserError(f"config key '{key}': {file} is not a Python module Python can load")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: its own classes and pickling find it by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any error in user code is reported as one line
        del sys.modules[name]
        raise UserError(f"config key '{key}': {file} failed to load: {type(exc).__name__}: {exc}") from None
    return module
