"""Name-resolve: where the processes of one run find each other, as files on the shared filesystem.

Keys are paths under ``<fileroot>/<experiment>/<trial>/name_resolve/``. Each file is one entry: its
value (``host:port``), the incarnation of the run that wrote it (``$AREAL_HPC_INCARNATION``: the Slurm
job id and restart count, or the local launch time), an instance id (one per registration, so a server
restarted at the same address is a new instance) and a heartbeat (the writer's clock at its last
refresh). Readers skip entries of another incarnation (a requeued job never sees the killed job's
servers) and entries whose heartbeat is older than ``STALE_AFTER_S`` (a process killed before it could
remove its file). Writes are atomic renames, so a reader sees a whole entry or none; NFS and Lustre both
honour that, and nothing else (no etcd, no Ray) needs to run on the cluster. Also here: the listening
socket a server binds, the address it advertises, and the directory of the run's rollout servers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from areal_hpc.errors import UserError
from areal_hpc.fsio import atomic_write_text
from areal_hpc.runtime.bootstrap import INCARNATION, node_address

ROLLOUT_SERVERS = "rollout/servers"
# A heartbeat every 5 s costs a shared filesystem one small rename per server; 30 s without one (six
# missed) means the writer is gone: long enough for a metadata server stall or clock skew between
# nodes, short enough that a restarted job or server is not kept waiting on a dead entry.
HEARTBEAT_INTERVAL_S = 5.0
STALE_AFTER_S = 30.0


@dataclass(frozen=True)
class Entry:
    value: str
    incarnation: str
    instance: str
    heartbeat: float  # time.time() of the writer at its last refresh


class NameResolve:
    def __init__(self, root: str | Path, incarnation: str | None = None, stale_after_s: float = STALE_AFTER_S):
        """``incarnation``: this process's launch (default: ``$AREAL_HPC_INCARNATION``); entries of
        another are skipped, and an empty one reads every incarnation."""
        self.root = Path(root)
        self.incarnation = os.environ.get(INCARNATION, "") if incarnation is None else incarnation
        self.stale_after_s = stale_after_s

    def add(self, key: str, value: str, instance: str = "") -> None:
        """Write ``key`` (or refresh it: same ``instance``) with this incarnation and a heartbeat of now."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = Entry(value, self.incarnation, instance or uuid.uuid4().hex, time.time())
        atomic_write_text(path, json.dumps(asdict(entry)))

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def entries(self, prefix: str) -> list[Entry]:
        """The live entries under ``prefix``, in key order: of this incarnation, with a recent heartbeat."""
        folder = self._path(prefix)
        if not folder.is_dir():
            return []
        now, live = time.time(), []
        for path in sorted(folder.iterdir()):
            if path.name.startswith(".") or not path.is_file():  # a write in progress, or a subfolder
                continue
            try:
                entry = Entry(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):  # removed meanwhile, or not an entry
                continue
            if (
                entry.incarnation == self.incarnation or not self.incarnation
            ) and now - entry.heartbeat <= self.stale_after_s:
                live.append(entry)
        return live

    def values(self, prefix: str) -> list[str]:
        """The values of the live entries under ``prefix``, in key order."""
        return [entry.value for entry in self.entries(prefix)]

    def _path(self, key: str) -> Path:
        parts = [p for p in key.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise UserError(f"name-resolve key {key!r} must be a relative path without '.' or '..'")
        return self.root.joinpath(*parts)


@contextlib.contextmanager
def registered(names: NameResolve, key: str, value: str, interval_s: float = HEARTBEAT_INTERVAL_S):
    """List ``key`` for as long as the block runs, its heartbeat refreshed every ``interval_s`` by a
    background thread (so it beats while the block's own thread serves or waits)."""
    instance, stop = uuid.uuid4().hex, threading.Event()
    names.add(key, value, instance)

    def beat() -> None:
        while not stop.wait(interval_s):
            try:
                names.add(key, value, instance)
            except OSError as exc:  # a filesystem hiccup: readers see the entry age, the next beat may work
                logging.getLogger(__name__).warning("name-resolve heartbeat of %s failed: %s", key, exc)

    heart = threading.Thread(target=beat, name=f"heartbeat {key}", daemon=True)
    heart.start()
    try:
        yield
    finally:
        stop.set()
        heart.join()  # no beat may re-create the entry after it is deleted
        names.delete(key)


def registered_server(run_dir: Path, address: str, interval_s: float = HEARTBEAT_INTERVAL_S):
    """List a rollout server under ``rollout/servers/`` for as long as the block runs."""
    return registered(NameResolve(Path(run_dir) / "name_resolve"), f"{ROLLOUT_SERVERS}/{address}", address, interval_s)


class ServerDirectory:
    """The run's rollout servers as name-resolve lists them, and which registered since the last look."""

    def __init__(self, names: NameResolve):
        self.names = names
        self._seen: dict[str, str] = {}  # address -> instance last reported

    def current(self) -> list[str]:
        """Every live server now; from here on ``changes`` reports only later registrations."""
        entries = self.names.entries(ROLLOUT_SERVERS)
        self._seen = {entry.value: entry.instance for entry in entries}
        return [entry.value for entry in entries]

    def changes(self) -> list[str]:
        """Servers registered since the last look: new addresses, and known ones whose process restarted."""
        fresh = [e for e in self.names.entries(ROLLOUT_SERVERS) if self._seen.get(e.value) != e.instance]
        self._seen.update((entry.value, entry.instance) for entry in fresh)
        return [entry.value for entry in fresh]


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
        raise UserError(
            f"cannot listen on {host}:{port}: {exc.strerror} (choose another port=, or port=0 for a free one)"
        ) from None
    sock.listen(128)
    return sock


def free_port(host: str) -> int:
    """A port nobody listens on right now, for a child that must be told its port before it starts (SGLang);
    another process may take it first: whoever can bind port 0 itself should."""
    with bind(host, 0) as sock:
        return sock.getsockname()[1]


def advertised_address(bind_host: str, port: int, interface: str = "") -> str:
    """``host:port`` other nodes can reach: when bound to every interface, the node's address (that of
    ``interface`` if given: ``cluster.interface``)."""
    host = node_address(interface) if bind_host in ("0.0.0.0", "") else bind_host
    return f"{host}:{port}"
