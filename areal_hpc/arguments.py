"""The command-line arguments ``areal-hpc``'s subcommands share: a run's ``--config FILE KEY=VALUE``, and a
flag that names an extension point's code, checked by the same rule as its config key.

The subcommands' modules beside their code (``train/cli.py``, ``launch/cli.py``, ...) declare their
arguments with these; it loads no config (that is ``config.py``'s, and heavier), so building the parser
stays light.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from areal_hpc import builtins
from areal_hpc.errors import UserError


def config_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """Declare ``--config FILE`` and the ``KEY=VALUE`` overrides on ``parser``."""
    parser.add_argument("--config", required=required, metavar="FILE", help="experiment YAML (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. actor.lr=1e-4")


def optional_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``config_arguments`` for a subcommand whose defaults are a whole run (``--config`` may be left out)."""
    config_arguments(parser, required=False)


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
