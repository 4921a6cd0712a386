"""A run never replaces an earlier one in its folder: `train` continues it (``--resume``, ``--resume=auto``) or is
refused in one line naming the folder, also when the earlier run stopped before its first checkpoint; `sft` and
`dpo` (and `rm`, through the same path) are refused before they write anything."""

from pathlib import Path

import pytest

from areal_hpc.config import load_config
from areal_hpc.errors import UserError
from areal_hpc.launch.local import should_resume
from tests.conftest import REPO, run_cli


def earlier_run(run_dir: Path) -> dict:
    """What a run stopped before its first checkpoint leaves (config, metrics, logs); a snapshot of it."""
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("experiment:\n  name: earlier\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.25}\n')
    (run_dir / "logs" / "failures.log").write_text("2026-12-06 10:00:00 first workflow: e1: KeyError: 'x'\n")
    return snapshot(run_dir)


def snapshot(folder: Path) -> dict:
    return {path.relative_to(folder): path.is_file() and path.read_bytes() for path in sorted(folder.rglob("*"))}


def test_train_continues_a_run_stopped_before_its_first_checkpoint_or_is_refused(tmp_path):
    cfg = load_config(str(REPO / "configs" / "quickstart.yaml"), [f"cluster.fileroot={tmp_path}"])
    assert should_resume(cfg, "never") is False and should_resume(cfg, "auto") is False
    with pytest.raises(UserError, match="nothing to resume"):
        should_resume(cfg, "always")
    before = earlier_run(cfg.run_dir)
    with pytest.raises(UserError) as refused:
        should_resume(cfg, "never")
    message = str(refused.value)
    assert message.startswith(f"{cfg.run_dir} already holds a run (config.yaml, metrics.jsonl)") and "\n" not in message
    assert "pass --resume to continue it (from step 0, with the episodes it stored)" in message
    assert should_resume(cfg, "always") is True and should_resume(cfg, "auto") is True  # a requeued job continues
    assert snapshot(cfg.run_dir) == before


@pytest.mark.parametrize(
    "command, config", [("sft", "configs/sft_tiny.yaml"), ("dpo", "configs/preference_arithmetic.yaml")]
)
def test_sft_and_dpo_refuse_a_folder_holding_an_earlier_run(tmp_path, tiny_model_dir, command, config):
    overrides = [f"cluster.fileroot={tmp_path}", f"model.path={tiny_model_dir}"]
    run_dir = load_config(str(REPO / config), overrides).run_dir
    before = earlier_run(run_dir)
    refused = run_cli(command, "--config", config, *overrides)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr[-2000:]
    assert refused.stderr.startswith(f"areal-hpc: error: {run_dir} already holds a run (config.yaml, metrics.jsonl)")
    assert "choose another experiment.trial=NAME" in refused.stderr
    assert snapshot(run_dir) == before
