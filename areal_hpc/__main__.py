"""``python -m areal_hpc`` is the same as the ``areal-hpc`` command."""

from areal_hpc.cli import run

run()
