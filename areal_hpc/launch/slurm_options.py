"""Slurm settings from the config in the forms sbatch and submitit take: a time limit in minutes, and
the user's extra ``#SBATCH`` lines as options. Shared by ``areal-hpc submit`` (``hetjob.py``) and
``areal-hpc sweep``; imports nothing heavy (the CLI loads it for every command).
"""

from __future__ import annotations

import re

from areal_hpc.errors import UserError


def slurm_minutes(text: str) -> int:
    """Minutes (rounded up) of a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise UserError(f"slurm.time: {text!r} is not a Slurm time limit (e.g. 30, 04:00:00, 2-00:00:00)")
    days, a, b, c = (int(g) if g else 0 for g in match.groups())
    if match.group(1):  # D-HH[:MM[:SS]]
        seconds = ((days * 24 + a) * 60 + b) * 60 + c
    elif match.group(4):  # HH:MM:SS
        seconds = (a * 60 + b) * 60 + c
    else:  # MM[:SS]
        seconds = a * 60 + b
    if seconds < 60:
        raise UserError(f"slurm.time: {text!r} is shorter than a minute")
    return -(-seconds // 60)


def extra_sbatch_options(lines: list[str]) -> dict[str, str | bool]:
    """``slurm.extra_sbatch`` (``["--exclusive", "--constraint=a100"]``) as sbatch options."""
    options: dict[str, str | bool] = {}
    for line in lines:
        option = line.removeprefix("#SBATCH").strip()
        if not option.startswith("--"):
            raise UserError(f"slurm.extra_sbatch: {line!r} is not of the form --option[=value] (e.g. --exclusive)")
        key, sep, value = option[2:].partition("=")
        options[key] = value if sep else True
    return options
