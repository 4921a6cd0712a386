"""File writes that survive a crash on a shared filesystem: of the process, and of the node.

A rename is only as durable as the data behind it and the folder holding it, so each helper fsyncs
the data before the rename and the folder after it. Append-only JSON-lines logs (metrics, the audit of
trained batches) are read back with ``read_json_lines``, which skips a line a crash cut short.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write so that a crash leaves either the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1))


def fsync_path(path: Path) -> None:
    """Put on disk a file's data (written through any handle) or a folder's entries (files created,
    renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file under ``root``, then every folder bottom-up (a folder's entries after its files)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(folder, name))
        fsync_path(Path(folder))


def read_json_lines(path: Path) -> list[dict]:
    """The records of a JSON-lines file (none if it does not exist yet); a line cut short by a crash, or
    still being written, is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
