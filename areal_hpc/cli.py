"""The ``areal-hpc`` command: one subcommand per job a user runs, all listed in the ``COMMANDS`` table.

Each row names a subcommand, its help line, the function that declares its arguments and the one that runs
it; both live beside the code they drive: ``train/cli.py`` (init-model, sft, dpo, rm, pairs, eval, export,
tree-cost, repro dta), ``launch/cli.py`` (train, submit, slurm-task), ``rollout/cli.py`` (serve), ``proxy/cli.py``,
``data/cli.py`` (shards), the planner's ``sched/cli.py``, the sweep's ``launch/sweep/cli.py`` and
``config.py`` (config show). A row names its handler as ``'module:function'``, imported only when that
subcommand runs; the modules that declare arguments import nothing heavy, so ``--help`` is instant.

User errors (bad config key, missing file, wrong value) print one line on stderr and exit with 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from areal_hpc.arguments import config_arguments, optional_config_arguments
from areal_hpc.data import cli as shards_cli
from areal_hpc.errors import UserError
from areal_hpc.launch import cli as launch_cli
from areal_hpc.launch.sweep import cli as sweep_cli
from areal_hpc.proxy import cli as proxy_cli
from areal_hpc.runtime.exit import exit_process
from areal_hpc.sched import cli as planner_cli
from areal_hpc.train import cli as train_cli


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors as one line (and exit code 2), like every other user error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


@dataclass(frozen=True)
class Command:
    """``areal-hpc NAME``: its help line, the function that declares its arguments on its parser and the one
    that runs it (returns the exit code), named ``'module:function'``: imported when the subcommand runs, so
    building the parser stays light."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: str


@dataclass(frozen=True)
class NestedCommand:
    """``areal-hpc NAME ACTION``: a subcommand made of subcommands, called ``metavar`` in its usage line."""

    name: str
    help: str
    metavar: str
    commands: tuple[Command, ...]


def load_handler(spec: str) -> Callable[[argparse.Namespace], int]:
    """The function a row names as ``'module:function'`` (its module imported now)."""
    module, _, name = spec.partition(":")
    function: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), name)
    return function


# Every subcommand, in the order `areal-hpc --help` lists them.
COMMANDS = (
    NestedCommand(
        "config",
        "inspect experiment configs",
        "ACTION",
        (
            Command(
                "show",
                "print the merged config (defaults <- YAML <- overrides)",
                config_arguments,
                "areal_hpc.config:run_config_show",
            ),
        ),
    ),
    Command(
        "init-model",
        "write a tiny Qwen2 model + tokenizer, built offline",
        train_cli.init_model_arguments,
        "areal_hpc.train.cli:run_init_model",
    ),
    Command("sft", "supervised fine-tuning with held-out evaluation", config_arguments, "areal_hpc.train.cli:run_sft"),
    Command(
        "pairs",
        "preference pairs from a model's own samples on a task: best- against worst-rewarded completion",
        train_cli.pairs_arguments,
        "areal_hpc.train.cli:run_pairs",
    ),
    Command(
        "dpo",
        "direct preference optimisation (DPO, cDPO, IPO) on preference pairs",
        config_arguments,
        "areal_hpc.train.cli:run_dpo",
    ),
    Command(
        "rm",
        "a Bradley-Terry reward model on preference pairs (score it as a reward with reward.model)",
        config_arguments,
        "areal_hpc.train.cli:run_rm",
    ),
    Command(
        "train",
        "asynchronous RL: rollout servers + trainer processes on this machine",
        launch_cli.train_arguments,
        "areal_hpc.launch.cli:run_train",
    ),
    Command(
        "submit",
        "submit a run as one heterogeneous Slurm job (trainer + rollout components, through submitit)",
        launch_cli.submit_arguments,
        "areal_hpc.launch.cli:run_submit",
    ),
    Command(
        "slurm-task",
        "one task of a run's Slurm job (what slurm/*.sbatch scripts run under srun); its role comes from its rank",
        config_arguments,
        "areal_hpc.launch.cli:run_slurm_task",
    ),
    Command(
        "eval",
        "a model on a task's held-out split through its workflow: accuracy, mean reward, pass@k",
        train_cli.eval_arguments,
        "areal_hpc.train.cli:run_eval",
    ),
    Command(
        "export",
        "a run's model (or a checkpoint's) as a Hugging Face folder: safetensors shards, config, tokenizer",
        train_cli.export_arguments,
        "areal_hpc.train.cli:run_export",
    ),
    Command(
        "tree-cost",
        "fit tree training's load-balancing cost model (actor.tree_cost) to runs' measured steps",
        train_cli.tree_cost_arguments,
        "areal_hpc.train.cli:run_tree_cost",
    ),
    Command(
        "serve",
        "run a rollout server (embedded engine or SGLang) with SGLang's HTTP API",
        optional_config_arguments,
        "areal_hpc.rollout.cli:run_serve",
    ),
    Command(
        "proxy",
        "the login-node proxy: an OpenAI-compatible gateway whose sessions become trajectory records "
        "(no GPU, no torch)",
        optional_config_arguments,
        "areal_hpc.proxy.cli:run_proxy",
    ),
    Command(
        "proxy-key",
        "make a tenant key for the proxy: prints it, stores its hash",
        proxy_cli.proxy_key_arguments,
        "areal_hpc.proxy.cli:run_proxy_key",
    ),
    NestedCommand(
        "shards",
        "inspect, verify and export trajectory shards",
        "ACTION",
        (
            Command(
                "inspect",
                "summary: trajectories, tokens, rewards, versions, tenants",
                shards_cli.shard_path_arguments,
                "areal_hpc.data.cli:run_inspect",
            ),
            Command(
                "verify",
                "check checksums, commit counts and manifests (exit 1 on damage)",
                shards_cli.shard_path_arguments,
                "areal_hpc.data.cli:run_verify",
            ),
            Command(
                "export",
                "write the trajectories as JSON lines or decoded text",
                shards_cli.export_arguments,
                "areal_hpc.data.cli:run_export",
            ),
        ),
    ),
    Command(
        "plan",
        "split a (heterogeneous) cluster between training and rollout",
        planner_cli.plan_arguments,
        "areal_hpc.sched.cli:run_plan",
    ),
    Command(
        "simulate",
        "discrete-event simulation of asynchronous RL on a saved plan",
        planner_cli.simulate_arguments,
        "areal_hpc.sched.cli:run_simulate",
    ),
    NestedCommand(
        "repro",
        "the papers' tables beside our predictions",
        "PAPER",
        (
            Command(
                "hex",
                "AReaL-Hex: Tables 1-4 and the same-budget ratios",
                planner_cli.repro_hex_arguments,
                "areal_hpc.sched.cli:run_repro_hex",
            ),
            Command(
                "areal-eta",
                "AReaL: throughput vs staleness (Table 7)",
                planner_cli.repro_arguments,
                "areal_hpc.sched.cli:run_repro_eta",
            ),
            Command(
                "dta",
                "AReaL-DTA: token compression and tree-vs-flat training speed (measured here, minutes)",
                train_cli.repro_dta_arguments,
                "areal_hpc.train.cli:run_repro_dta",
            ),
        ),
    ),
    Command(
        "sweep",
        "a grid of runs as one Slurm job array (submitit), and its results",
        sweep_cli.sweep_arguments,
        "areal_hpc.launch.sweep.cli:run_sweep",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="areal-hpc", description="Asynchronous RL of LLMs on Slurm clusters (AReaL, packaged for HPC)."
    )
    _add_commands(parser, "COMMAND", COMMANDS)
    return parser


def _add_commands(parser: argparse.ArgumentParser, metavar: str, commands: tuple[Command | NestedCommand, ...]) -> None:
    """The table's rows as ``parser``'s subcommands; the one given lands in ``args.<metavar, lower case>``."""
    subparsers = parser.add_subparsers(dest=metavar.lower(), metavar=metavar, parser_class=OneLineParser, required=True)
    for command in commands:
        sub = subparsers.add_parser(command.name, help=command.help)
        if isinstance(command, NestedCommand):
            _add_commands(sub, command.metavar, command.commands)
        else:
            command.arguments(sub)
            sub.set_defaults(handler=command.run)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return load_handler(args.handler)(args)
    except UserError as exc:
        print(f"areal-hpc: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("areal-hpc: interrupted", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The ``areal-hpc`` command: ``main`` with the arguments of the command line, then the process ends
    at once (``runtime.exit``)."""
    exit_process(main())


if __name__ == "__main__":
    run()
