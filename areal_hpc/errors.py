"""Errors a user can cause: the CLI prints them as one line and exits with code 2. And where the user's own
code (a reward, a workflow) failed: the file and line to show with its message."""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import re
import site
import sysconfig
import traceback
from pathlib import Path


class UserError(Exception):
    """Bad input from the user (a config key, a path, a value): reported without a traceback."""


def closest(word: str, candidates) -> str:
    """Return ", did you mean 'x'?" for the nearest candidate, or "" when nothing is close."""
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.5)
    return f", did you mean '{match[0]}'?" if match else ""


@functools.cache
def _not_users() -> tuple[str, ...]:
    """Folders of code that is not the user's: this package, the standard library, installed packages
    (computed on the first failure, not when every process imports this module)."""
    folders = [
        str(Path(__file__).parent),
        *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
        *site.getsitepackages(),
        site.getusersitepackages(),
    ]
    return tuple(sorted({os.path.realpath(p) + os.sep for p in folders}))


def _users(filename: str) -> bool:
    return not filename.startswith("<") and not os.path.realpath(filename).startswith(_not_users())


def _shown(filename: str) -> str:
    """A path relative to the working folder when it is inside it, else absolute."""
    path = os.path.realpath(filename)
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def user_location(exc: BaseException) -> str | None:
    """ "file.py:12": the deepest frame of ``exc``'s traceback in the user's code (outside this package, the
    standard library and installed packages), or None when the user's code is not in it."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if _users(frame.filename):
            return f"{_shown(frame.filename)}:{frame.lineno}"
    return None


PYTHON_FRAME = re.compile(r'^ *File "(.+)", line (\d+)', re.M)


def traceback_location(text: str) -> str | None:
    """ "file.py:12": the deepest frame in the user's code of the last Python traceback in ``text`` (e.g. what
    a program wrote to stderr), or None when there is none."""
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return None
    for filename, line in reversed(PYTHON_FRAME.findall(text[start:])):
        if _users(filename):
            return f"{_shown(filename)}:{line}"
    return None


def definition_site(obj) -> str | None:
    """ "file.py:12" where the user's function (or a callable object's class) is defined, or None when it is
    not the user's code or its source is unknown."""
    target = obj if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isclass(obj) else type(obj)
    try:
        filename, line = inspect.getsourcefile(target), inspect.getsourcelines(target)[1]
    except (OSError, TypeError):
        return None
    return f"{_shown(filename)}:{line}" if filename and _users(filename) else None


def described(exc: BaseException, text: str | None = None) -> str:
    """One line on ``exc``: ``text`` (default "Type: message") and, when the user's code raised it, "(file.py:12)"."""
    where = user_location(exc)
    line = " ".join((f"{type(exc).__name__}: {exc}" if text is None else text).split())
    return f"{line} ({where})" if where else line
