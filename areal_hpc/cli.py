"""The ``areal-hpc`` command: one subcommand per job a user runs, all listed in the ``COMMANDS`` table.

Each row names a subcommand, its help line, the function that declares its arguments and the one that runs
it; the planner's (``sched/cli.py``) and the sweep's (``launch/sweep/cli.py``) live beside their code.

User errors (bad config key, missing file, wrong value) print one line on stderr and exit with 2.
Heavy modules (torch, transformers) are imported inside the subcommands, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from areal_hpc import builtins
from areal_hpc.errors import UserError
from areal_hpc.launch.sweep import cli as sweep_cli
from areal_hpc.runtime.exit import exit_process
from areal_hpc.sched import cli as planner_cli


def extension(point: str) -> Callable[[str], str]:
    """An argparse ``type`` for a flag that names ``point``'s code: a built-in's name or the user's spec,
    checked by the same rule as its config key (``builtins.check``)."""

    def checked(value: str) -> str:
        try:
            builtins.check(point, value)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    checked.__name__ = builtins.POINTS[point].key  # argparse names the type in its error line
    return checked


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors as one line (and exit code 2), like every other user error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


@dataclass(frozen=True)
class Command:
    """``areal-hpc NAME``: its help line, the function that declares its arguments on its parser and the one
    that runs it (returns the exit code; it imports what it needs, so building the parser stays light)."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class NestedCommand:
    """``areal-hpc NAME ACTION``: a subcommand made of subcommands, called ``metavar`` in its usage line."""

    name: str
    help: str
    metavar: str
    commands: tuple[Command, ...]


def _config_arguments(parser, required: bool = True) -> None:
    parser.add_argument("--config", required=required, metavar="FILE", help="experiment YAML (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. actor.lr=1e-4")


def _optional_config_arguments(parser) -> None:
    _config_arguments(parser, required=False)


def _config_show(args) -> int:
    from areal_hpc.config import load_config, to_yaml

    print(to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def _init_model_arguments(init) -> None:
    init.add_argument("--out", required=True, metavar="DIR", help="output folder (Hugging Face format)")
    init.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "small", "tiny-moe"],
        help="model size and kind (default: tiny; tiny-moe: a Qwen3-MoE with 8 experts)",
    )
    init.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")


def _init_model(args) -> int:
    from areal_hpc.data.registry import corpus_for_tokenizer
    from areal_hpc.models.hf import load_model
    from areal_hpc.models.tiny import count_parameters, init_model

    out = init_model(args.out, corpus_for_tokenizer(args.seed), preset=args.preset, seed=args.seed)
    model = load_model(out)
    print(
        f"wrote {args.preset} {type(model).__name__} ({count_parameters(model) / 1e6:.2f}M parameters) "
        f"and tokenizer to {out}"
    )
    return 0


def _sft(args) -> int:
    from areal_hpc.config import load_config

    cfg = load_config(args.config, args.overrides)  # a bad value refused before torch is imported
    from areal_hpc.train.sft import run_sft

    result = run_sft(cfg)
    print(
        f"eval accuracy: before {result.before.summary()} -> after {result.after.summary()} "
        f"in {result.seconds:.0f} s; model saved to {result.model_dir}"
    )
    return 0


def _preference(objective: str):
    def command(args) -> int:
        from areal_hpc.config import load_config

        cfg = load_config(args.config, args.overrides)  # a bad value refused before torch is imported
        from areal_hpc.train.preference import run_preference

        result = run_preference(cfg, objective)
        shown = {key.removeprefix("eval/"): value for key, value in result.after.items()}
        print(
            f"{objective}: held-out pair accuracy before {result.before.get('eval/pair_accuracy', float('nan')):.1%}"
            f" -> after {shown.get('pair_accuracy', float('nan')):.1%}"
            + (f", task accuracy {shown['accuracy']:.1%}" if "accuracy" in shown else "")
            + f" in {result.seconds:.0f} s; model saved to {result.model_dir}"
        )
        return 0

    return command


def _pairs_arguments(pairs) -> None:
    pairs.add_argument("--model", required=True, metavar="DIR", help="the model whose samples make the pairs")
    pairs.add_argument("--out", required=True, metavar="FILE.jsonl", help="where the pairs are written")
    pairs.add_argument("--samples", type=int, default=4, metavar="N", help="completions sampled per prompt (default 4)")
    pairs.add_argument(
        "--split", choices=["train", "eval"], default="train", help="the task's prompts to sample on (default: train)"
    )
    pairs.add_argument("--limit", type=int, help="use only the first N prompts")
    pairs.add_argument(
        "--pairing",
        choices=["best-worst", "all"],
        default="best-worst",
        help="per prompt: its best completion against its worst (default), or every completion "
        "against every one rewarded lower (more pairs, the near misses too)",
    )
    _optional_config_arguments(pairs)


def _pairs(args) -> int:
    from areal_hpc.config import load_config
    from areal_hpc.train.preference_pairs import pairs_from_episodes

    cfg = load_config(args.config, args.overrides)
    if args.samples < 2:
        raise UserError(f"--samples must be at least 2 completions per prompt to compare, got {args.samples}")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be a positive number of prompts, got {args.limit}")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UserError(f"--out {args.out}: folder {out.parent} does not exist")
    task, examples, result = _model_episodes(cfg, args.model, args.split, args.limit, args.samples)
    rows = pairs_from_episodes(result.episodes, args.samples, args.pairing)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(
        f"{len(rows)} pairs from {len(examples)} {task.name} prompts ({args.samples} samples each; prompts whose "
        f"samples all scored alike give none) written to {out}"
    )
    return 0


def _tree_cost_arguments(fit) -> None:
    fit.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="run folders trained with actor.tree_training=dta (their metrics.jsonl)",
    )


def _tree_cost(args) -> int:
    from areal_hpc.algo.tree_balance import TREE_FEATURES, fit_from_records
    from areal_hpc.fsio import read_json_lines

    records = []
    for run in map(Path, args.runs):
        if not (run / "metrics.jsonl").is_file():
            raise UserError(f"{run} has no metrics.jsonl; give the folder of a run (e.g. <fileroot>/<name>/trial0)")
        records += read_json_lines(run / "metrics.jsonl")
    coefficients, error, steps = fit_from_records(records)
    print(
        f"fitted on {steps} steps (median error {error:.1%}): "
        + ", ".join(f"{name} {c:.3g} s" for name, c in zip(TREE_FEATURES, coefficients))
    )
    print("actor.tree_cost=[" + ",".join(f"{c:.4g}" for c in coefficients) + "]")
    return 0


def _repro_dta_arguments(paper) -> None:
    paper.add_argument("--json", action="store_true", help="one JSON object per row")
    paper.add_argument("--preset", default="small", choices=["tiny", "small"], help="model trained (default: small)")
    paper.add_argument("--steps", type=int, default=3, help="timed optimizer steps per variant (default: 3)")
    paper.add_argument("--quick", action="store_true", help="small workloads, tiny model, 1 step: a check that it runs")


def _repro_dta(args) -> int:
    from areal_hpc.sched.report import table
    from areal_hpc.train import repro_dta

    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    preset, steps, timed = ("tiny", 1, repro_dta.QUICK) if args.quick else (args.preset, args.steps, repro_dta.TIMED)
    rows = repro_dta.dta_rows(preset, steps, timed, progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        for row in rows:
            print(json.dumps(row.to_dict()))
        return 0
    print(f"AReaL-DTA (tree training) vs ours: model preset '{preset}', one CPU thread, median of {steps} steps\n")
    print(
        table(
            ["row", "paper", "ours", "ours/paper", "workload"],
            [
                [
                    r.row,
                    "-" if r.paper is None else f"{r.paper:.2f}x",
                    f"{r.ours:.2f}x",
                    "-" if r.ratio is None else f"{r.ratio:.2f}",
                    r.workload,
                ]
                for r in rows
            ],
        )
    )
    print()
    for note in repro_dta.NOTES:
        print(f"- {note}")
    return 0


def _eval_arguments(ev) -> None:
    ev.add_argument("--model", required=True, metavar="DIR", help="local Hugging Face model folder")
    ev.add_argument(
        "--task",
        type=extension("task"),
        metavar="TASK",
        help=f"dataset.task: {builtins.describe('task')} (default: the config's; custom: dataset.path and reward.fn)",
    )
    ev.add_argument("--limit", type=int, help="evaluate only the first N held-out problems")
    ev.add_argument(
        "--samples",
        type=int,
        default=1,
        metavar="N",
        help="episodes per prompt: 1 is greedy; N > 1 samples at gconfig.temperature (pass@k)",
    )
    ev.add_argument("--out", metavar="FILE.jsonl", help="write every episode (prompt, completion, reward) here")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    _optional_config_arguments(ev)


def _model_episodes(cfg, model: str, split: str, limit: int | None, samples: int):
    """(task, examples, result): ``samples`` episodes (greedy when 1) of the model on the first ``limit`` prompts
    of the task's ``split`` ("train" or "eval"), in this process through the embedded engine, scored by the
    task's reward."""
    from areal_hpc.agents.engine import Sampling
    from areal_hpc.agents.registry import build_workflow
    from areal_hpc.models.hf import load_model, load_tokenizer
    from areal_hpc.parallel.device import resolve_device
    from areal_hpc.train.evaluate import evaluate_model
    from areal_hpc.train.task_setup import open_task, reward_pool

    tokenizer = load_tokenizer(model)
    task = open_task(cfg, tokenizer, model, lambda line: print(line, file=sys.stderr))
    examples = (task.train if split == "train" else task.eval)[:limit]
    workflow = build_workflow(cfg.rollout)
    network = load_model(model, cfg.model.dtype, cfg.model.attn_impl, resolve_device(cfg.cluster.device))
    with reward_pool(cfg, task) as rewards:
        result = evaluate_model(
            network,
            tokenizer,
            examples,
            rewards,
            Sampling.from_config(cfg.gconfig),
            workflow,
            model,
            n_samples=samples,
            greedy=samples == 1,
            discount=cfg.rollout.turn_discount,
            seed=cfg.experiment.seed,
        )
    return task, examples, result


def _eval(args) -> int:
    from areal_hpc.config import load_config

    overrides = list(args.overrides) + ([f"dataset.task={args.task}"] if args.task else [])
    cfg = load_config(args.config, overrides)
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be a positive number of problems, got {args.limit}")
    if args.samples < 1:
        raise UserError(f"--samples must be a positive number of episodes per prompt, got {args.samples}")
    out = Path(args.out) if args.out else None
    if out is not None and not out.parent.is_dir():
        raise UserError(f"--out {args.out}: folder {out.parent} does not exist")
    task, _, result = _model_episodes(cfg, args.model, "eval", args.limit, args.samples)
    if out is not None:
        out.write_text("".join(json.dumps(row) + "\n" for row in result.episodes))
    passes = {f"pass@{k}": v for k, v in result.pass_at.items()}
    if args.json:
        print(
            json.dumps(
                {
                    "task": task.name,
                    "model": args.model,
                    "accuracy": result.accuracy,
                    "n": result.n,
                    "correct": result.correct,
                    "mean_reward": result.mean_reward,
                    "samples": args.samples,
                    **passes,
                    "reward_failures": result.reward_failures,
                    "episode_failures": result.episode_failures,
                }
            )
        )
    else:
        for prompt, completion, value in result.samples:
            print(f"  {prompt!r} -> {completion!r}  reward {value:g}")
        shown = "  ".join(f"{k} {v:.1%}" for k, v in passes.items())
        print(
            f"{task.name} accuracy of {args.model}: {result.summary()}, mean reward {result.mean_reward:.3f}, "
            f"{shown}" + (f"; episodes written to {out}" if out else "")
        )
    return 0


def _exit_1_on_damage(handler):
    """Shard commands: data that cannot be read (damaged, truncated) is one line on stderr and exit 1."""

    def run(args) -> int:
        from areal_hpc.data.shards import ShardDamageError

        try:
            return handler(args)
        except ShardDamageError as exc:
            print(f"areal-hpc: error: {exc}", file=sys.stderr)
            return 1

    return run


def _shard_path_argument(parser) -> None:
    parser.add_argument(
        "path",
        metavar="PATH",
        help="a shard file (.h5) or a folder of shards, e.g. <fileroot>/<experiment>/<trial>/shards",
    )
    parser.add_argument(
        "--metadata-wait",
        type=_seconds,
        metavar="S",
        help="how long a live shard's metadata may fail its checksum (its writer may be rewriting "
        "it) before it counts as damage (default: 1 s)",
    )


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds >= 0")
    return seconds


def _metadata_wait(args) -> float:
    """``--metadata-wait``, else the readers' default (imported only now, so building the parser stays light)."""
    from areal_hpc.data.shards.format import METADATA_WAIT

    return METADATA_WAIT if args.metadata_wait is None else args.metadata_wait


@_exit_1_on_damage
def _shards_inspect(args) -> int:
    from areal_hpc.data.shards.report import inspect, open_store, problems_line

    with open_store(args.path, _metadata_wait(args)) as store:
        if store.shards:
            print(inspect(store))
        if store.problems():
            print(f"areal-hpc: error: {problems_line(store)}", file=sys.stderr)
            return 1
    return 0


@_exit_1_on_damage
def _shards_verify(args) -> int:
    from areal_hpc.data.shards.report import verify

    damage, notes, records = verify(Path(args.path), _metadata_wait(args))
    for line in notes:
        print(f"note: {line}")
    for line in damage:
        print(f"DAMAGE: {line}")
    print(f"{args.path}: {'damage found' if damage else 'ok'}, {records:,} committed records checked")
    return 1 if damage else 0


def _shards_export_arguments(export) -> None:
    _shard_path_argument(export)
    export.add_argument("--format", choices=["jsonl"], default="jsonl", help="output format (default: jsonl)")
    export.add_argument("--output", metavar="FILE", help="write here instead of standard output")
    export.add_argument("--tenant", help="only this tenant's trajectories")
    export.add_argument("--eligible-only", action="store_true", help="only trajectories eligible for training")
    export.add_argument("--min-version", type=int, metavar="V", help="oldest output token at least policy version V")
    export.add_argument("--max-version", type=int, metavar="V", help="newest output token at most policy version V")


@_exit_1_on_damage
def _shards_export(args) -> int:
    from areal_hpc.data.shards import ShardDamageError
    from areal_hpc.data.shards.reader import TrajectoryFilter
    from areal_hpc.data.shards.report import export_jsonl, open_store, problems_line

    where = TrajectoryFilter(
        tenant=args.tenant, min_version=args.min_version, max_version=args.max_version, eligible_only=args.eligible_only
    )
    with open_store(args.path, _metadata_wait(args)) as store:
        if store.problems():  # an export that silently left records out would look complete
            raise ShardDamageError(problems_line(store))
        if args.output is None:
            export_jsonl(store, sys.stdout, where)
            return 0
        staging = Path(f"{args.output}.partial")  # a failed export never leaves a half-written file
        try:
            with open(staging, "w") as out:
                n = export_jsonl(store, out, where)
            staging.replace(args.output)
        except OSError as exc:
            raise UserError(f"cannot write {args.output}: {exc.strerror}") from None
        finally:
            staging.unlink(missing_ok=True)
    print(f"wrote {n:,} trajectories to {args.output}", file=sys.stderr)
    return 0


def _train_arguments(train) -> None:
    _config_arguments(train)
    train.add_argument(
        "--resume",
        nargs="?",
        const="always",
        default="never",
        choices=["always", "auto", "never"],
        help="continue the run from its latest checkpoint; --resume=auto: continue if there is "
        "one, else start (what a requeued job does)",
    )


def _train(args) -> int:
    from areal_hpc.launch.local import launch

    return launch(args.config, args.overrides, args.resume)


def _submit_arguments(sub) -> None:
    _config_arguments(sub)
    sub.add_argument(
        "--profile", metavar="FILE", help="site profile YAML under the config (e.g. slurm/profiles/dev.yaml)"
    )
    sub.add_argument(
        "--plan",
        metavar="FILE",
        help="`areal-hpc plan --out` output: its pools' partitions become the job's components",
    )
    sub.add_argument(
        "--resume",
        nargs="?",
        const="always",
        default="never",
        choices=["always", "auto", "never"],
        help="as for `train`: continue the run folder's run (a requeued job always does)",
    )
    sub.add_argument(
        "--dry-run",
        action="store_true",
        help="print the job script and check it with `sbatch --test-only`; submit nothing",
    )
    sub.add_argument(
        "--check-memory",
        metavar="DEVICE",
        help="refuse the run, before anything is queued, if a "
        "trainer rank or a rollout server would not fit in DEVICE's memory: a device type (H100, H20, "
        "...) or a size in GB (e.g. 24)",
    )


def _submit(args) -> int:
    from areal_hpc.launch.submit import describe, prepare, script, submit, test_only

    submission = prepare(args.config, args.overrides, args.profile, args.plan, args.resume)
    if args.check_memory:
        from areal_hpc.engines.torch.outputs import LOGITS_CHUNK_BYTES

        print(planner_cli.check_run_memory(submission.cfg, args.check_memory, LOGITS_CHUNK_BYTES), file=sys.stderr)
    if args.dry_run:
        print(script(submission))
        print(f"sbatch --test-only: {test_only(script(submission))}", file=sys.stderr)
        return 0
    job = submit(submission)
    print(describe(submission, job.job_id))
    return 0


def _slurm_task(args) -> int:
    from areal_hpc.launch.slurm_task import main

    return main(args.config, args.overrides)


# `areal-hpc serve backend=embedded model.path=DIR port=N`: the server's own words for its settings.
SERVE_ALIASES = {"backend": "rollout.backend", "host": "rollout.host", "port": "rollout.port"}


def _serve(args) -> int:
    from areal_hpc.config import load_config

    overrides = [_serve_alias(item) for item in args.overrides]
    cfg = load_config(args.config, overrides)
    if not cfg.model.path:
        raise UserError("serve needs model.path=DIR (a local Hugging Face model folder)")
    if cfg.rollout.backend == "embedded":
        from areal_hpc.rollout.server import serve_embedded

        serve_embedded(cfg)
    else:
        from areal_hpc.rollout.sglang_server import serve_sglang

        serve_sglang(cfg)
    return 0


def _proxy(args) -> int:
    from areal_hpc.config import load_config
    from areal_hpc.proxy.serve import serve_proxy

    serve_proxy(load_config(args.config, args.overrides))
    return 0


def _proxy_key_arguments(key) -> None:
    key.add_argument("--keys-file", required=True, metavar="FILE", help="the proxy's keys file (proxy.keys_file)")
    key.add_argument("--tenant", required=True, help="tenant name (letters, digits, '_', '.', '-')")


def _proxy_key(args) -> int:
    from areal_hpc.proxy.tenants import add_key

    key = add_key(args.keys_file, args.tenant)
    print(key)
    print(
        f"added a key for tenant {args.tenant} to {args.keys_file} (only its hash is stored: keep the key)",
        file=sys.stderr,
    )
    return 0


def _serve_alias(item: str) -> str:
    key, sep, value = item.partition("=")
    return f"{SERVE_ALIASES.get(key, key)}{sep}{value}"


# Every subcommand, in the order `areal-hpc --help` lists them.
COMMANDS = (
    NestedCommand(
        "config",
        "inspect experiment configs",
        "ACTION",
        (Command("show", "print the merged config (defaults <- YAML <- overrides)", _config_arguments, _config_show),),
    ),
    Command("init-model", "write a tiny Qwen2 model + tokenizer, built offline", _init_model_arguments, _init_model),
    Command("sft", "supervised fine-tuning with held-out evaluation", _config_arguments, _sft),
    Command(
        "pairs",
        "preference pairs from a model's own samples on a task: best- against worst-rewarded completion",
        _pairs_arguments,
        _pairs,
    ),
    Command(
        "dpo",
        "direct preference optimisation (DPO, cDPO, IPO) on preference pairs",
        _config_arguments,
        _preference("dpo"),
    ),
    Command(
        "rm",
        "a Bradley-Terry reward model on preference pairs (score it as a reward with reward.model)",
        _config_arguments,
        _preference("rm"),
    ),
    Command("train", "asynchronous RL: rollout servers + trainer processes on this machine", _train_arguments, _train),
    Command(
        "submit",
        "submit a run as one heterogeneous Slurm job (trainer + rollout components, through submitit)",
        _submit_arguments,
        _submit,
    ),
    Command(
        "slurm-task",
        "one task of a run's Slurm job (what slurm/*.sbatch scripts run under srun); its role comes from its rank",
        _config_arguments,
        _slurm_task,
    ),
    Command(
        "eval",
        "a model on a task's held-out split through its workflow: accuracy, mean reward, pass@k",
        _eval_arguments,
        _eval,
    ),
    Command(
        "tree-cost",
        "fit tree training's load-balancing cost model (actor.tree_cost) to runs' measured steps",
        _tree_cost_arguments,
        _tree_cost,
    ),
    Command(
        "serve",
        "run a rollout server (embedded engine or SGLang) with SGLang's HTTP API",
        _optional_config_arguments,
        _serve,
    ),
    Command(
        "proxy",
        "the login-node proxy: an OpenAI-compatible gateway whose sessions become trajectory records "
        "(no GPU, no torch)",
        _optional_config_arguments,
        _proxy,
    ),
    Command(
        "proxy-key", "make a tenant key for the proxy: prints it, stores its hash", _proxy_key_arguments, _proxy_key
    ),
    NestedCommand(
        "shards",
        "inspect, verify and export trajectory shards",
        "ACTION",
        (
            Command(
                "inspect",
                "summary: trajectories, tokens, rewards, versions, tenants",
                _shard_path_argument,
                _shards_inspect,
            ),
            Command(
                "verify",
                "check checksums, commit counts and manifests (exit 1 on damage)",
                _shard_path_argument,
                _shards_verify,
            ),
            Command("export", "write the trajectories as JSON lines", _shards_export_arguments, _shards_export),
        ),
    ),
    Command(
        "plan",
        "split a (heterogeneous) cluster between training and rollout",
        planner_cli.plan_arguments,
        planner_cli.run_plan,
    ),
    Command(
        "simulate",
        "discrete-event simulation of asynchronous RL on a saved plan",
        planner_cli.simulate_arguments,
        planner_cli.run_simulate,
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
                planner_cli.run_repro_hex,
            ),
            Command(
                "areal-eta",
                "AReaL: throughput vs staleness (Table 7)",
                planner_cli.repro_arguments,
                planner_cli.run_repro_eta,
            ),
            Command(
                "dta",
                "AReaL-DTA: token compression and tree-vs-flat training speed (measured here, minutes)",
                _repro_dta_arguments,
                _repro_dta,
            ),
        ),
    ),
    Command(
        "sweep",
        "a grid of runs as one Slurm job array (submitit), and its results",
        sweep_cli.sweep_arguments,
        sweep_cli.run_sweep,
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
        return args.handler(args)
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
