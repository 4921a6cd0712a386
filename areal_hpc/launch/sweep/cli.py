"""The ``areal-hpc sweep`` subcommand: its arguments, and submitting a grid or reporting on a sweep folder."""

from __future__ import annotations

from pathlib import Path

from areal_hpc.errors import UserError


def sweep_arguments(sweep) -> None:
    """Declare ``sweep``'s arguments on its parser."""
    sweep.add_argument("--config", metavar="FILE", help="experiment YAML (see configs/)")
    sweep.add_argument(
        "--profile", metavar="FILE", help="site profile YAML under the config (e.g. slurm/profiles/dev.yaml)"
    )
    sweep.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides for every point, and the grid: sweep.KEY=[v1,v2,...] per swept key",
    )
    sweep.add_argument(
        "--name",
        help="sweep name: its folder under <cluster.fileroot>/<experiment.name>/ (default: sweep-<date>-<time>)",
    )
    sweep.add_argument("--parallel", type=int, metavar="N", help="array elements running at once (default: all)")
    sweep.add_argument(
        "--status",
        metavar="DIR",
        help="the state of the sweep in DIR (a sweep folder) and, when every point has finished, its results",
    )
    sweep.add_argument("--wait", action="store_true", help="block (with a progress line) until every point finishes")


def run_sweep(args) -> int:
    from areal_hpc.launch.sweep.results import report
    from areal_hpc.launch.sweep.submit import submit

    if args.status:
        if args.config or args.profile or args.overrides or args.name or args.parallel is not None:
            raise UserError("sweep --status DIR takes no --config, --profile, --name, --parallel or KEY=VALUE items")
        folder = Path(args.status)
    else:
        if not args.config:
            raise UserError("sweep needs --config FILE (or --status DIR to look at a submitted sweep)")
        folder = submit(args.config, args.overrides, args.name, args.parallel, args.profile)
        if not args.wait:
            return 0
    return report(folder, wait=args.wait)
