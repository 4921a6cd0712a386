"""The run's rollout token: a secret in ``<run folder>/rollout_token`` (mode 0600) that rollout servers
bound beyond loopback require on their routes (``Authorization: Bearer <token>``), so their generate and
weight-update routes are open only to the run's own processes (trainer, proxy), never to the network.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path

from areal_hpc.errors import UserError

TOKEN_FILE = "rollout_token"


def rollout_token(run_dir: str | Path, create: bool = False) -> str | None:
    """The run's token; with ``create``, made first if the run has none. It appears whole or not at all
    (written 0600 beside it, then hard-linked into place, which fails if another server of the run was
    first), so servers starting together agree on one token and none reads a half-written one. None
    when there is none and ``create`` is false."""
    path = Path(run_dir) / TOKEN_FILE
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32))
                out.flush()
                os.fsync(out.fileno())
            os.link(staging, path)
        except FileExistsError:  # another server of the run made it first
            pass
        finally:
            staging.unlink(missing_ok=True)
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def server_token(run_dir: str | Path, host: str) -> str | None:
    """What a rollout server bound to ``host`` requires: the run's token (made if the run has none yet)
    when other hosts can reach it, else None. It never serves beyond loopback without one."""
    if not needs_token(host):
        return None
    token = rollout_token(run_dir, create=True)
    if token is None:
        raise UserError(f"{Path(run_dir) / TOKEN_FILE} is empty; remove it to have a new token made")
    return token


def needs_token(host: str) -> bool:
    """A server bound to ``host`` must check the token unless only this machine can reach it."""
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host != "localhost"
