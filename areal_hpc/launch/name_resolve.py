"""Name-resolve: where the processes of one run find each other, as files on the shared filesystem.

Keys are paths under ``<fileroot>/<experiment>/<trial>/name_resolve/``; values are small strings
(``host:port``). Writes are atomic renames, so a reader sees a whole value or none; NFS and Lustre
both honour that, and nothing else (no etcd, no Ray) needs to run on the cluster.
"""

from __future__ import annotations

from pathlib import Path

from areal_hpc.errors import UserError
from areal_hpc.fsio import atomic_write_text

ROLLOUT_SERVERS = "rollout/servers"


class NameResolve:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def add(self, key: str, value: str) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, value)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def values(self, prefix: str) -> list[str]:
        """Every value under ``prefix``, in key order."""
        folder = self._path(prefix)
        if not folder.is_dir():
            return []
        return [p.read_text() for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")]

    def _path(self, key: str) -> Path:
        parts = [p for p in key.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise UserError(f"name-resolve key {key!r} must be a relative path without '.' or '..'")
        return self.root.joinpath(*parts)
