"""One engine factory (``engines.factory.build_engine``): a user's engine named by ``actor.engine`` trains an RL
run (after its SFT warm-up) and DPO with no other file changed, and inherits the torch engine's capabilities;
the Megatron engine refuses the roles it does not build in one line, before anything imports Megatron."""

from __future__ import annotations

import sys
import textwrap

import pytest
from rich.console import Console

from areal_hpc.config import load_config
from areal_hpc.engines.factory import build_engine
from areal_hpc.errors import UserError
from areal_hpc.resolve import Host, resolve
from areal_hpc.train.preference import run_preference
from tests.conftest import run_cli
from tests.system.test_async_rl import SMALL_RUN
from tests.train.test_preference import ARITHMETIC_PAIRS, pair_run_args, write_pairs

TOY_ENGINE = '''
from pathlib import Path

from areal_hpc.engines.torch.engine import TorchTrainEngine


class ToyEngine(TorchTrainEngine):
    """The torch engine, recording each role it builds (in every process) beside this file."""

    @classmethod
    def build(cls, role, cfg, mesh, path, tokenizer):
        engine = super().build(role, cfg, mesh, path, tokenizer)
        with open(Path(__file__).with_name("built.txt"), "a") as out:
            out.write(f"{role} {type(engine).__name__}\\n")
        return engine
'''


def toy_engine(folder) -> str:
    (folder / "toy.py").write_text(textwrap.dedent(TOY_ENGINE))
    return f"actor.engine={folder / 'toy.py'}:ToyEngine"


def built(folder) -> set[str]:
    return set((folder / "built.txt").read_text().splitlines())


@pytest.mark.slow
@pytest.mark.distributed
def test_a_users_engine_trains_sft_rl_and_dpo(tiny_model_dir, tmp_path):
    engine = toy_engine(tmp_path)
    rl = run_cli(
        "train",
        "--config",
        "configs/quickstart.yaml",
        f"model.path={tiny_model_dir}",
        f"cluster.fileroot={tmp_path}",
        *SMALL_RUN,
        "rl.sft_warmup_steps=2",
        "rl.total_train_steps=1",
        "rl.eval_every_steps=0",
        "actor.kl_coef=0.1",
        engine,
        timeout=300,
    )
    assert rl.returncode == 0, rl.stderr[-3000:]
    assert built(tmp_path) == {"sft ToyEngine", "policy ToyEngine", "reference ToyEngine"}
    pairs = write_pairs(tmp_path / "pairs.jsonl", ARITHMETIC_PAIRS)
    cfg = load_config("configs/quickstart.yaml", pair_run_args("dpo", tiny_model_dir, tmp_path, pairs, engine)[3:])
    run_preference(resolve(cfg, Host.probe()).cfg, "dpo", Console(quiet=True))
    assert "dpo ToyEngine" in built(tmp_path)


def test_a_subclass_of_the_torch_engine_inherits_its_capabilities(tmp_path):
    cfg = load_config(None, ["actor.tree_training=auto", toy_engine(tmp_path)])
    assert resolve(cfg, Host("cpu")).cfg.actor.tree_training == "dta"


@pytest.mark.parametrize("role", ["sft", "dpo", "rm"])
def test_megatron_refuses_a_role_it_does_not_build_in_one_line_before_importing_megatron(role, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # an import of Megatron from here on fails
    cfg = load_config(None, ["actor.engine=megatron"])
    with pytest.raises(UserError) as refused:
        build_engine(role, cfg, None, "unused", None)
    assert str(refused.value).startswith("actor.engine=megatron does not train ")
    assert f"({role}) yet; use actor.engine=torch" in str(refused.value) and "\n" not in str(refused.value)
