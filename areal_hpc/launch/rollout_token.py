"""The run's rollout token: a secret in ``<run folder>/rollout_token`` (mode 0600) that rollout servers
bound beyond loopback require on their routes (``Authorization: Bearer <token>``), so their generate and
weight-update routes are open only to the run's own processes (trainer, proxy), never to the network.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path

TOKEN_FILE = "rollout_token"


def rollout_token(run_dir: str | Path, create: bool = False) -> str | None:
    """The run's token; with ``create``, made first if the run has none (created 0600 in one step, so
    servers starting together agree on one token). None when there is none and ``create`` is false."""
    path = Path(run_dir) / TOKEN_FILE
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another server of the run made it first
            pass
        else:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32))
                out.flush()
                os.fsync(out.fileno())
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def needs_token(host: str) -> bool:
    """A server bound to ``host`` must check the token unless only this machine can reach it."""
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host != "localhost"
