"""Name-resolve: where the processes of one run find each other, as files on the shared filesystem.

Keys are paths under ``<fileroot>/<experiment>/<trial>/name_resolve/``; values are small strings
(``host:port``). Writes are atomic renames, so a reader sees a whole value or none; NFS and Lustre
both honour that, and nothing else (no etcd, no Ray) needs to run on the cluster. Also here: the
listening socket a server binds and the address it advertises.
"""

from __future__ import annotations

import contextlib
import socket
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


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), so the real address is known before the app runs.

    It listens at once: clients that find the address in name-resolve while the app is still starting
    wait in the backlog instead of being refused.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror} (choose another port=, or port=0 "
                        "for a free one)") from None
    sock.listen(128)
    return sock


def free_port(host: str) -> int:
    """A port nobody listens on right now (for a child process or a rendezvous to take)."""
    with bind(host, 0) as sock:
        return sock.getsockname()[1]


def advertised_address(bind_host: str, port: int) -> str:
    """``host:port`` other nodes can reach: the node's name when bound to every interface."""
    host = socket.gethostname() if bind_host in ("0.0.0.0", "") else bind_host
    return f"{host}:{port}"


@contextlib.contextmanager
def registered_server(run_dir: Path, address: str):
    """List a rollout server under ``rollout/servers/`` for as long as the block runs."""
    names = NameResolve(Path(run_dir) / "name_resolve")
    names.add(f"{ROLLOUT_SERVERS}/{address}", address)
    try:
        yield
    finally:
        names.delete(f"{ROLLOUT_SERVERS}/{address}")
