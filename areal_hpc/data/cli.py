"""``areal-hpc shards inspect | verify | export``: trajectory shards' subcommands, each as the function that
declares its arguments and the one that runs it; ``areal_hpc/cli.py`` lists them in its table.

    areal-hpc shards verify <fileroot>/<experiment>/<trial>/shards
    areal-hpc shards export PATH --tenant alice --eligible-only --output trajectories.jsonl
    areal-hpc shards export <run>/shards --text | less      # decoded by the run's tokenizer

They sit beside ``shards/`` rather than in it: that package imports h5py, and building the parser stays
light. Data that cannot be read (damaged, truncated) is one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

from areal_hpc.errors import UserError

Handler = Callable[[argparse.Namespace], int]


def _exit_1_on_damage(handler: Handler) -> Handler:
    """Shard commands: data that cannot be read (damaged, truncated) is one line on stderr and exit 1."""

    def run(args: argparse.Namespace) -> int:
        from areal_hpc.data.shards import ShardDamageError

        try:
            return handler(args)
        except ShardDamageError as exc:
            print(f"areal-hpc: error: {exc}", file=sys.stderr)
            return 1

    return run


def shard_path_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the shard path and ``--metadata-wait`` on ``parser`` (``inspect``'s and ``verify``'s arguments)."""
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


def _metadata_wait(args: argparse.Namespace) -> float:
    """``--metadata-wait``, else the readers' default (imported only now, so building the parser stays light)."""
    from areal_hpc.data.shards.format import METADATA_WAIT

    return METADATA_WAIT if args.metadata_wait is None else args.metadata_wait


@_exit_1_on_damage
def run_inspect(args: argparse.Namespace) -> int:
    from areal_hpc.data.shards.report import inspect, open_store, problems_line

    with open_store(args.path, _metadata_wait(args)) as store:
        if store.shards:
            print(inspect(store))
        if store.problems():
            print(f"areal-hpc: error: {problems_line(store)}", file=sys.stderr)
            return 1
    return 0


@_exit_1_on_damage
def run_verify(args: argparse.Namespace) -> int:
    from areal_hpc.data.shards.report import verify

    damage, notes, records = verify(Path(args.path), _metadata_wait(args))
    for line in notes:
        print(f"note: {line}")
    for line in damage:
        print(f"DAMAGE: {line}")
    print(f"{args.path}: {'damage found' if damage else 'ok'}, {records:,} committed records checked")
    return 1 if damage else 0


def export_arguments(export: argparse.ArgumentParser) -> None:
    """Declare ``shards export``'s arguments on its parser."""
    shard_path_arguments(export)
    export.add_argument(
        "--format",
        choices=["jsonl", "text"],
        default="jsonl",
        help="output format: jsonl (token ids, logprobs, versions, loss masks), or text: each record decoded by "
        "the run's tokenizer, its context (the messages' roles, never trained) and model turns (trained "
        "tokens, versions, reward) apart (default: jsonl)",
    )
    export.add_argument("--text", dest="format", action="store_const", const="text", help="--format text")
    export.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="--format text: the model folder whose tokenizer decodes (default: the run's, from the "
        "config.yaml of the run folder holding PATH)",
    )
    export.add_argument("--output", metavar="FILE", help="write here instead of standard output")
    export.add_argument("--tenant", help="only this tenant's trajectories")
    export.add_argument("--eligible-only", action="store_true", help="only trajectories eligible for training")
    export.add_argument("--min-version", type=int, metavar="V", help="oldest output token at least policy version V")
    export.add_argument("--max-version", type=int, metavar="V", help="newest output token at most policy version V")


@_exit_1_on_damage
def run_export(args: argparse.Namespace) -> int:
    from areal_hpc.data.shards import ShardDamageError
    from areal_hpc.data.shards.reader import TrajectoryFilter
    from areal_hpc.data.shards.report import export_jsonl, export_text, open_store, problems_line, shard_tokenizer

    where = TrajectoryFilter(
        tenant=args.tenant, min_version=args.min_version, max_version=args.max_version, eligible_only=args.eligible_only
    )
    export: Callable[..., int] = export_jsonl
    if args.format == "text":  # the tokenizer first: a run without one writes nothing
        export = functools.partial(export_text, tokenizer=shard_tokenizer(args.path, args.tokenizer))
    with open_store(args.path, _metadata_wait(args)) as store:
        if store.problems():  # an export that silently left records out would look complete
            raise ShardDamageError(problems_line(store))
        if args.output is None:
            export(store, sys.stdout, where)
            return 0
        staging = Path(f"{args.output}.partial")  # a failed export never leaves a half-written file
        try:
            with open(staging, "w") as out:
                n = export(store, out, where)
            staging.replace(args.output)
        except OSError as exc:
            raise UserError(f"cannot write {args.output}: {exc.strerror}") from None
        finally:
            staging.unlink(missing_ok=True)
    print(f"wrote {n:,} trajectories to {args.output}", file=sys.stderr)
    return 0
