"""User code named in a config: ``"package.module:name"`` (importable) or ``"path/to/file.py:name"``.

``load_object`` imports it once per process and checks it is callable, or raises one ``UserError``
line naming the config key, the value and what would be valid. A file is loaded under a module name
derived from its absolute path, so the same file gives the same objects however often it is named.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

from areal_hpc.errors import UserError

FORMS = "'package.module:name' or 'path/to/file.py:name'"


def split_spec(spec: str, key: str) -> tuple[str, str]:
    source, sep, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not source or not name.isidentifier():
        raise UserError(f"config key '{key}': {spec!r} is not {FORMS}")
    return source, name


def load_object(spec: str, key: str):
    """The callable ``spec`` names (``key``: the config key, for the error line)."""
    source, name = split_spec(spec, key)
    module = _module_of_file(source, key) if source.endswith(".py") else _import(source, key)
    obj = getattr(module, name, None)
    if obj is None:
        raise UserError(f"config key '{key}': {spec!r}: {module.__name__} has no {name!r} "
                        f"(it defines {', '.join(n for n in dir(module) if not n.startswith('_'))[:300]})")
    if not callable(obj):
        raise UserError(f"config key '{key}': {spec!r} is a {type(obj).__name__}, not a function or class")
    return obj


def _import(dotted: str, key: str):
    try:
        return importlib.import_module(dotted)
    except ImportError as exc:
        raise UserError(f"config key '{key}': cannot import {dotted!r}: {exc} (install it, or give {FORMS})") from None


def _module_of_file(path: str, key: str):
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise UserError(f"config key '{key}': no file {str(file)!r} (a Python file, relative to the working folder)")
    name = f"areal_user_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: its own classes and pickling find it by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any error in user code is reported as one line
        del sys.modules[name]
        raise UserError(f"config key '{key}': {file} failed to load: {type(exc).__name__}: {exc}") from None
    return module
