"""The ``areal-hpc`` command: one subcommand per job a user runs.

User errors (bad config key, missing file, wrong value) print one line on stderr and exit with 2.
Heavy modules (torch, transformers) are imported inside the subcommands, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys

from areal_hpc.errors import UserError


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors as one line (and exit code 2), like every other user error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _config_show(args) -> int:
    from areal_hpc.config import load_config, to_yaml

    print(to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def _init_model(args) -> int:
    from areal_hpc.models.hf import load_model
    from areal_hpc.models.tiny import count_parameters, init_model

    out = init_model(args.out, preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} Qwen2 model ({count_parameters(load_model(out)) / 1e6:.2f}M parameters) "
          f"and tokenizer to {out}")
    return 0


def _sft(args) -> int:
    from areal_hpc.config import load_config
    from areal_hpc.train.sft import run_sft

    result = run_sft(load_config(args.config, args.overrides))
    print(f"eval accuracy: before {result.before.summary()} -> after {result.after.summary()} "
          f"in {result.seconds:.0f} s; model saved to {result.model_dir}")
    return 0


def _eval(args) -> int:
    from areal_hpc.config import load_config
    from areal_hpc.data.rewards import RewardPool
    from areal_hpc.data.tasks import build_task
    from areal_hpc.models.hf import load_model, load_tokenizer
    from areal_hpc.parallel.device import resolve_device
    from areal_hpc.train.evaluate import evaluate

    overrides = list(args.overrides) + ([f"dataset.task={args.task}"] if args.task else [])
    cfg = load_config(args.config, overrides)
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be a positive number of problems, got {args.limit}")
    task = build_task(cfg.dataset)
    model = load_model(args.model, cfg.model.dtype, cfg.model.attn_impl, resolve_device(cfg.cluster.device))
    tokenizer = load_tokenizer(args.model)
    with RewardPool(task.reward) as rewards:
        result = evaluate(model, tokenizer, task.eval[: args.limit], rewards, cfg.gconfig.max_new_tokens)
    if args.json:
        print(json.dumps({"task": task.name, "model": args.model, "accuracy": result.accuracy, "n": result.n,
                          "correct": result.correct, "mean_reward": result.mean_reward}))
    else:
        for prompt, completion, value in result.samples:
            print(f"  {prompt!r} -> {completion!r}  reward {value:g}")
        print(f"{task.name} accuracy of {args.model}: {result.summary()}, mean reward {result.mean_reward:.3f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="areal-hpc",
                           description="Asynchronous RL of LLMs on Slurm clusters (AReaL, packaged for HPC).")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser, required=True)

    def with_config(p, required=True):
        p.add_argument("--config", required=required, metavar="FILE", help="experiment YAML (see configs/)")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. actor.lr=1e-4")

    config = commands.add_parser("config", help="inspect experiment configs")
    config_commands = config.add_subparsers(dest="action", metavar="ACTION", parser_class=OneLineParser,
                                            required=True)
    show = config_commands.add_parser("show", help="print the merged config (defaults <- YAML <- overrides)")
    with_config(show)
    show.set_defaults(handler=_config_show)

    init = commands.add_parser("init-model", help="write a tiny Qwen2 model + tokenizer, built offline")
    init.add_argument("--out", required=True, metavar="DIR", help="output folder (Hugging Face format)")
    init.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="model size (default: tiny)")
    init.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")
    init.set_defaults(handler=_init_model)

    sft = commands.add_parser("sft", help="supervised fine-tuning with held-out evaluation")
    with_config(sft)
    sft.set_defaults(handler=_sft)

    ev = commands.add_parser("eval", help="greedy accuracy of a model on a task's held-out split")
    ev.add_argument("--model", required=True, metavar="DIR", help="local Hugging Face model folder")
    ev.add_argument("--task", choices=["arithmetic", "countdown", "gsm8k"], help="task (default: the config's)")
    ev.add_argument("--limit", type=int, help="evaluate only the first N held-out problems")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    with_config(ev, required=False)
    ev.set_defaults(handler=_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UserError as exc:
        print(f"areal-hpc: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("areal-hpc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
