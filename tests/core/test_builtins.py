"""One table of built-ins (``areal_hpc/builtins.py``): every extension point's names live there and nowhere
else in the package; the config's validation, the CLI's flags and the docs' reference read it; every
built-in loads, and a user's own ``'file.py:Name'`` or ``'package.module:Name'`` loads at every point the
same way."""

from __future__ import annotations

import ast
import dataclasses
import sys
import textwrap
import typing
from pathlib import Path

import pytest

from areal_hpc import builtins
from areal_hpc.builtins import POINTS
from areal_hpc.config import RunConfig, load_config
from areal_hpc.errors import UserError
from tests.conftest import run_cli

PACKAGE = Path(__file__).resolve().parents[2] / "areal_hpc"
ROOT = PACKAGE.parent


def _identifiers(node: ast.AST) -> set[str]:
    """The names an expression reads: ``cfg.actor.engine`` -> {cfg, actor, engine}."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _subject_words(point: str) -> set[str]:
    """What code that holds a ``point`` value calls it: the config field and the point's own name."""
    field = POINTS[point].key.rsplit(".", 1)[1]
    return {field, point, point.rsplit("_", 1)[-1]}


def names_outside_the_table(source: str, where: str) -> list[str]:
    """Each place in ``source`` that decides by a built-in's name: a comparison of a value named like the
    point's key with one of its names, or a literal tuple/list/set/dict listing two of one point's names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for point, entry in POINTS.items():
            names = {n for n in entry.names if n}
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                named = {s for op in operands for s in _strings(op)} & names
                subject = any(_identifiers(op) & _subject_words(point) for op in operands)
                if named and subject:
                    found.append(f"{where}:{node.lineno}: compares with {point} name(s) {sorted(named)}")
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                listed = {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}
                if len(listed) >= 2:
                    found.append(f"{where}:{node.lineno}: lists {point} names {sorted(listed)}")
    return found


def test_no_built_in_name_is_decided_outside_the_table():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "builtins.py" or path.parent != PACKAGE:
            found += names_outside_the_table(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "built-in names belong to areal_hpc/builtins.py only:\n" + "\n".join(found)


def test_the_scan_finds_a_second_list_and_a_comparison_by_name():
    planted = textwrap.dedent("""
        LOSSES = ("ppo", "sapo")
        def pick(cfg):
            if cfg.actor.engine == "megatron":
                return 1
            return estimator in {"grpo": 1, "rloo": 2}
        def fine(device):
            return device == "cuda" and ("torch",)
    """)
    found = names_outside_the_table(planted, "planted.py")
    assert [line.split(": ", 1)[1] for line in found] == [
        "lists policy_loss names ['ppo', 'sapo']",
        "compares with train_engine name(s) ['megatron']",
        "compares with advantage_estimator name(s) ['grpo', 'rloo']",
        "lists advantage_estimator names ['grpo', 'rloo']",
    ], found


def _fields_by_key() -> dict[str, dataclasses.Field]:
    fields = {}

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            else:
                fields[prefix + f.name] = f

    walk(RunConfig, "")
    return fields


def test_every_extension_point_is_a_config_key_checked_by_the_table():
    fields = _fields_by_key()
    marked = {key: f.metadata["point"] for key, f in fields.items() if f.metadata.get("point")}
    assert marked == {entry.key: point for point, entry in POINTS.items()}
    for point, entry in POINTS.items():
        assert not fields[entry.key].metadata.get("choices"), f"{entry.key} keeps a second list of choices"
        default = fields[entry.key].default
        assert default == entry.default, f"{entry.key}: the config's default {default!r} is not the table's"
        for name in entry.names:
            builtins.check(point, name)
        with pytest.raises(UserError, match=rf"config key '{entry.key}': 'no_such_thing' is not a built-in \("):
            load_config(overrides=[f"{entry.key}=no_such_thing"])


def test_every_built_in_loads_to_what_its_contract_names():
    for point, entry in POINTS.items():
        for name in entry.builtins:
            obj = builtins.load(point, name)
            assert obj is builtins.load(point, entry.builtins[name])  # one object, by name or by spec
            if point in ("workflow", "train_engine"):
                assert isinstance(obj, type), f"{point} {name}: {obj!r} is not a class"
            elif point == "policy_loss":
                assert callable(obj.surrogate) and isinstance(obj.trust_region, bool)
            else:
                assert callable(obj)


USER_CODE = {  # point: (a file of the user's, the name a config gives)
    "task": ("def make(cfg):\n    return cfg\n", "make"),
    "workflow": ("class Agent:\n    async def arun_episode(self, engine, example):\n        return None\n", "Agent"),
    "train_engine": (
        "from areal_hpc.engines.torch.engine import TorchTrainEngine\nclass Engine(TorchTrainEngine):\n    pass\n",
        "Engine",
    ),
    "policy_loss": (
        "from areal_hpc.algo.policy_losses import PolicyLoss\n"
        "LOSS = PolicyLoss(lambda ratio, adv, cfg: (ratio * adv, ratio < 0))\n",
        "LOSS",
    ),
    "advantage_estimator": ("def estimate(rewards, group_ids, eps):\n    return rewards\n", "estimate"),
    "reward": ("def score(prompt, completion, prompt_ids, completion_ids, **fields):\n    return 1.0\n", "score"),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_your_own_code_loads_at_every_point_the_same_way(point, tmp_path, monkeypatch):
    source, name = USER_CODE[point]
    module = f"user_{point}_code"
    (tmp_path / f"{module}.py").write_text(source)
    by_file = builtins.load(point, f"{tmp_path / module}.py:{name}")
    assert by_file is builtins.load(point, f"{tmp_path / module}.py:{name}")  # imported once
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = builtins.load(point, f"{module}:{name}")
    assert by_module is getattr(sys.modules[module], name) and type(by_module).__name__ == type(by_file).__name__
    with pytest.raises(UserError) as missing:
        builtins.load(point, f"{tmp_path / module}.py:absent")
    assert (
        str(missing.value).startswith(f"config key '{POINTS[point].key}': ")
        and "has no 'absent'" in str(missing.value)
        and "\n" not in str(missing.value)
    )
    sys.modules.pop(module, None)


def test_a_keyword_names_no_code():
    with pytest.raises(UserError, match="'custom' names no code"):
        builtins.load("task", "custom")
    assert builtins.uses_critic("ppo") and not builtins.uses_critic("grpo")
    assert builtins.is_custom_task("custom") and not builtins.is_custom_task("gsm8k")


def test_the_cli_takes_what_the_config_takes(tmp_path):
    every = POINTS["task"].names
    bad = run_cli("eval", "--model", str(tmp_path), "--task", "no_such_task")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert f"is not a built-in ({', '.join(every)})" in bad.stderr
    help_text = " ".join(run_cli("eval", "--help").stdout.split())
    assert f"a built-in ({', '.join(every)})" in help_text


def test_the_docs_reference_lists_the_table():
    page = (ROOT / "docs" / "reference" / "builtins.md").read_text()
    config_page = (ROOT / "docs" / "reference" / "config.md").read_text()
    for entry in POINTS.values():
        assert f"## {entry.key}" in page
        for name, spec in entry.builtins.items():
            assert f"| `{name}` | `{spec}` |" in page
        row = next(line for line in config_page.splitlines() if line.startswith(f"| `{entry.key}` |"))
        assert " \\| ".join(f"`{n}`" for n in entry.names if n) in row.replace('`""` \\| ', ""), row


def test_a_built_in_reward_named_by_its_short_name_reaches_workers_as_its_spec():
    from areal_hpc.config import DatasetConfig, RewardConfig
    from areal_hpc.data.registry import build_task

    task = build_task(DatasetConfig(train_size=4, eval_size=2), RewardConfig(fn="exact_match"))
    assert task.reward.target == POINTS["reward"].builtins["exact_match"]  # a spec: worker processes import it
    example = task.eval[0]
    assert task.reward.load()("q", f"Answer: {example.answer}", [], [], answer=example.answer) == 1.0


def test_the_built_in_engines_capabilities_are_their_classes():
    """resolve() reads a built-in engine's capabilities from builtins' table (no torch import): the table must
    say what the class says."""
    for name, capabilities in builtins.ENGINE_CAPABILITIES.items():
        engine = builtins.load("train_engine", name)
        assert capabilities == {c: getattr(engine, c) for c in capabilities}, name
    assert set(builtins.ENGINE_CAPABILITIES) == set(builtins.POINTS["train_engine"].builtins)


def test_a_model_family_a_path_does_not_take_is_refused_by_name():
    from transformers import MistralConfig

    from areal_hpc.engines.megatron.convert import ModelShape

    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(UserError) as refused:
        ModelShape.from_hf(config)
    assert str(refused.value) == (
        "the Megatron engine takes qwen2, qwen3, qwen3_moe, llama, gemma3_text models, not 'mistral': "
        "train it with actor.engine=torch"
    )
    assert builtins.family_supports("llama", "embedded decoder") and not builtins.family_supports("gemma3", "x")
