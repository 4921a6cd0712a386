"""The areal-hpc command as users run it: help, config show, and exit code 2 with one line on bad input."""

import subprocess
import sys

import pytest

from areal_hpc.cli import COMMANDS, Command, load_handler
from tests.conftest import REPO, run_cli


def test_help_lists_the_subcommands():
    out = run_cli("--help")
    assert out.returncode == 0
    for command in ("config", "init-model", "sft", "eval"):
        assert command in out.stdout


def test_config_show_prints_the_merged_config():
    out = run_cli("config", "show", "--config", "configs/quickstart.yaml", "actor.lr=1e-4")
    assert out.returncode == 0, out.stderr
    assert "actor:\n  lr: 0.0001\n" in out.stdout
    assert "experiment:\n  name: quickstart\n" in out.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["config", "show", "--config", "configs/quickstart.yaml", "actor.lrr=1e-4"],
            ["actor.lrr", "did you mean 'actor.lr'"],
        ),
        (["config", "show", "--config", "configs/missing.yaml"], ["config file not found", "configs/missing.yaml"]),
        (
            ["config", "show", "--config", "configs/quickstart.yaml", "sft.batch_size=lots"],
            ["sft.batch_size", "lots", "int"],
        ),
        (["config", "show"], ["--config"]),
        (["sft", "--config", "configs/quickstart.yaml", "dataset.task=chess"], ["dataset.task", "chess", "arithmetic"]),
        (["init-model", "--out", "/tmp/x", "--preset", "huge"], ["--preset", "huge", "tiny"]),
        (["eval", "--model", "/nonexistent/model", "--task", "arithmetic"], ["/nonexistent/model", "config.json"]),
        (["eval", "--model", "/tmp", "--task", "poetry"], ["--task", "poetry"]),
        (["frobnicate"], ["frobnicate"]),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(args, words):
    out = run_cli(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for word in words:
        assert word in out.stderr


def test_bad_override_loses_nothing_already_written(tmp_path):
    run_dir = tmp_path / "quickstart" / "trial0"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("previous run\n")
    out = run_cli("sft", "--config", "configs/quickstart.yaml", f"cluster.fileroot={tmp_path}", "sft.lr=-1")
    assert out.returncode == 2
    assert (run_dir / "config.yaml").read_text() == "previous run\n"


def test_init_model_then_eval_reports_accuracy(tmp_path):
    out = run_cli("init-model", "--out", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr
    assert "M parameters" in out.stdout
    out = run_cli("eval", "--model", str(tmp_path / "m"), "--task", "countdown", "--limit", "5", "--json")
    assert out.returncode == 0, out.stderr
    assert '"n": 5' in out.stdout and '"accuracy": 0.0' in out.stdout  # an untrained model solves nothing
    assert (REPO / "configs").is_dir()


def test_missing_gsm8k_file_is_reported_before_anything_is_written(tmp_path):
    out = run_cli(
        "sft",
        "--config",
        "configs/sft_tiny.yaml",
        f"cluster.fileroot={tmp_path}",
        "dataset.task=gsm8k",
        f"dataset.path={tmp_path}/absent.jsonl",
    )
    assert out.returncode == 2
    assert "absent.jsonl" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "sft_tiny" / "trial0" / "config.yaml").exists()


def _rows(commands):
    for command in commands:
        yield from [command] if isinstance(command, Command) else _rows(command.commands)


def test_every_row_names_a_handler_and_the_parser_loads_nothing_heavy():
    """Handlers live beside their code and are imported only when their subcommand runs: each row's
    'module:function' must name a function, and building the parser (``--help``) loads no torch, no
    config (omegaconf) and no shards (h5py)."""
    rows = list(_rows(COMMANDS))
    assert len(rows) == len({row.run for row in rows}), "two rows run the same handler"
    for row in rows:
        assert callable(load_handler(row.run)), row.run
    code = (
        "import sys; from areal_hpc.cli import build_parser; build_parser()\n"
        "print(sorted(m for m in ('torch', 'transformers', 'omegaconf', 'h5py', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[]\n"
