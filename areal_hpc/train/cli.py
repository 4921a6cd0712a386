"""``areal-hpc init-model | sft | dpo | rm | pairs | eval | export | tree-cost | repro dta``: the training package's
subcommands, each as the function that declares its arguments and the one that runs it; ``areal_hpc/cli.py``
lists them in its table.

    areal-hpc init-model --out runs/tiny            areal-hpc sft --config configs/sft_tiny.yaml
    areal-hpc eval --model runs/tiny --task countdown --limit 50
    areal-hpc export runs/quickstart/trial0 --out hf/quickstart --dtype bfloat16
    areal-hpc pairs --model DIR --config configs/preference_arithmetic.yaml --out pairs.jsonl
    areal-hpc dpo --config configs/preference_arithmetic.yaml preference.path=pairs.jsonl

Torch and the models are imported inside the functions that run, so building the parser stays light.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from areal_hpc import builtins
from areal_hpc.arguments import extension, optional_config_arguments
from areal_hpc.errors import UserError
from areal_hpc.models.chat_families import FAMILIES


def init_model_arguments(init: argparse.ArgumentParser) -> None:
    """Declare ``init-model``'s arguments on its parser."""
    init.add_argument("--out", required=True, metavar="DIR", help="output folder (Hugging Face format)")
    init.add_argument(
        "--preset",
        default="tiny",
        choices=list(builtins.MODEL_PRESETS),
        help="model size and kind (default: tiny; tiny-moe: a Qwen3-MoE with 8 experts; *-replica: a released "
        "model's structure at a small size)",
    )
    init.add_argument(
        "--template",
        choices=list(FAMILIES),
        help="the tokenizer's chat template and special tokens (default: the replica's original's, else chatml)",
    )
    init.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")


def run_init_model(args: argparse.Namespace) -> int:
    from areal_hpc.data.registry import corpus_for_tokenizer
    from areal_hpc.models.hf import load_model
    from areal_hpc.models.tiny import count_parameters, init_model

    out = init_model(
        args.out, corpus_for_tokenizer(args.seed), preset=args.preset, seed=args.seed, template=args.template
    )
    model = load_model(out)
    print(
        f"wrote {args.preset} {type(model).__name__} ({count_parameters(model) / 1e6:.2f}M parameters) "
        f"and tokenizer to {out}"
    )
    return 0


def export_arguments(export: argparse.ArgumentParser) -> None:
    """Declare ``export``'s arguments on its parser."""
    export.add_argument(
        "path",
        metavar="RUN_OR_CHECKPOINT",
        help="a run folder (its newest model: model/ or the latest checkpoint), a checkpoint, or a saved model folder",
    )
    export.add_argument("--out", required=True, metavar="DIR", help="new (or empty) folder for the Hugging Face model")
    export.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights' dtype (default: bfloat16)"
    )
    export.add_argument(
        "--max-shard-size",
        default="2GB",
        metavar="SIZE",
        help="largest safetensors shard, e.g. 2GB, 500MB, 5GiB (default: 2GB); one file when the model fits",
    )


def run_export(args: argparse.Namespace) -> int:
    from transformers.utils.hub import convert_file_size_to_int

    from areal_hpc.models.export import export_model, refuse_non_empty
    from areal_hpc.runtime.run_state import model_to_export

    try:
        limit = convert_file_size_to_int(args.max_shard_size)
    except ValueError:
        limit = 0
    if limit <= 0:
        raise UserError(f"--max-shard-size {args.max_shard_size!r} is not a size; use e.g. 2GB, 500MB or 5GiB")
    out = Path(args.out)
    refuse_non_empty(out)
    source = model_to_export(Path(args.path))
    exported = export_model(source, out, args.dtype, limit)
    print(
        f"exported {source} to {out}: {exported.tensors} tensors in {args.dtype}, {exported.bytes / 1e6:.1f} MB "
        f"in {exported.shards} shard{'s' if exported.shards > 1 else ''}"
    )
    return 0


def run_sft(args: argparse.Namespace) -> int:
    from areal_hpc.config import load_config
    from areal_hpc.resolve import Host, resolve
    from areal_hpc.runtime.run_state import refuse_previous_run

    cfg = resolve(load_config(args.config, args.overrides), Host.probe()).cfg  # refused before torch is imported
    refuse_previous_run(cfg.run_dir)
    from areal_hpc.train import sft

    result = sft.run_sft(cfg)
    print(
        f"eval accuracy: before {result.before.summary()} -> after {result.after.summary()} "
        f"in {result.seconds:.0f} s; model saved to {result.model_dir}"
    )
    return 0


def run_dpo(args: argparse.Namespace) -> int:
    return _preference(args, "dpo")


def run_rm(args: argparse.Namespace) -> int:
    return _preference(args, "rm")


def _preference(args: argparse.Namespace, objective: str) -> int:
    from areal_hpc.config import load_config
    from areal_hpc.resolve import Host, resolve
    from areal_hpc.runtime.run_state import refuse_previous_run

    cfg = resolve(load_config(args.config, args.overrides), Host.probe()).cfg  # refused before torch is imported
    refuse_previous_run(cfg.run_dir)
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


def pairs_arguments(pairs: argparse.ArgumentParser) -> None:
    """Declare ``pairs``' arguments on its parser."""
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
    optional_config_arguments(pairs)


def run_pairs(args: argparse.Namespace) -> int:
    from areal_hpc.config import load_config
    from areal_hpc.resolve import Host, resolve
    from areal_hpc.train.preference_pairs import pairs_from_episodes

    cfg = resolve(load_config(args.config, args.overrides), Host.probe()).cfg
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


def eval_arguments(ev: argparse.ArgumentParser) -> None:
    """Declare ``eval``'s arguments on its parser."""
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
        help="episodes per prompt: 1 is greedy; N > 1 samples at generation.temperature (pass@k)",
    )
    ev.add_argument("--out", metavar="FILE.jsonl", help="write every episode (prompt, completion, reward) here")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    optional_config_arguments(ev)


def _model_episodes(cfg: Any, model: str, split: str, limit: int | None, samples: int) -> tuple[Any, Any, Any]:
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
            Sampling.from_config(cfg.generation),
            workflow,
            model,
            n_samples=samples,
            greedy=samples == 1,
            discount=cfg.rollout.turn_discount,
            seed=cfg.experiment.seed,
        )
    return task, examples, result


def run_eval(args: argparse.Namespace) -> int:
    """The model's accuracy; with failed episodes or rewards, the first of each kind, a last line saying how many
    (on stderr with ``--json``), and exit status ``rollout.failure_budget.exit_code_on_failures``."""
    from areal_hpc.config import load_config
    from areal_hpc.resolve import Host, resolve
    from areal_hpc.rollout.controller import FAILURE_KINDS
    from areal_hpc.train.failure_report import FailureReport

    overrides = list(args.overrides) + ([f"dataset.task={args.task}"] if args.task else [])
    cfg = resolve(load_config(args.config, overrides), Host.probe()).cfg
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
    stream = sys.stderr if args.json else sys.stdout  # with --json stdout holds the JSON object alone
    report = FailureReport(lambda line: print(line, file=stream), None, "the last line")
    report.show_new(result.failures)
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
                    "failures": {kind: result.failures.counts[kind] for kind in FAILURE_KINDS},
                    "first_failures": result.failures.first,
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
    return report.finish(result.failures, cfg.rollout.failure_budget.exit_code_on_failures)


def tree_cost_arguments(fit: argparse.ArgumentParser) -> None:
    """Declare ``tree-cost``'s arguments on its parser."""
    fit.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="run folders trained with actor.tree_training=dta (their metrics.jsonl)",
    )


def run_tree_cost(args: argparse.Namespace) -> int:
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


def repro_dta_arguments(paper: argparse.ArgumentParser) -> None:
    """Declare ``repro dta``'s arguments on its parser."""
    paper.add_argument("--json", action="store_true", help="one JSON object per row")
    paper.add_argument("--preset", default="small", choices=["tiny", "small"], help="model trained (default: small)")
    paper.add_argument("--steps", type=int, default=3, help="timed optimizer steps per variant (default: 3)")
    paper.add_argument("--quick", action="store_true", help="small workloads, tiny model, 1 step: a check that it runs")


def run_repro_dta(args: argparse.Namespace) -> int:
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
