"""Ended sessions kept on disk for the reward grace period, so a restarted proxy still takes their late
rewards: one small JSON file per session in ``<shards dir>/ended-sessions/``, beside the records it
names, written when the session's records are, removed when the grace period is over.

A file holds what a reward needs and nothing of the conversation: the tenant, the hashes of the
session's key and of the tenant key that opened it, each turn's interaction id and the turn it extends,
the rewards so far, and which record holds each conversation (the tokens are in the records).
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

from areal_hpc.fsio import atomic_write_text
from areal_hpc.proxy.sessions import Session, Turn

log = logging.getLogger(__name__)

SESSION_ID = re.compile(r"[0-9a-f]{32}")


class EndedSessions:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def save(self, session: Session) -> None:
        """Write (or rewrite, after a late reward) what a restarted proxy needs to reward ``session``."""
        index = {id(t): n for n, t in enumerate(session.turns)}
        ended = time.time() - (time.monotonic() - session.ended_at)  # the monotonic end as wall-clock time
        state = {
            "id": session.id,
            "tenant": session.tenant,
            "tenant_key_hash": session.tenant_key_hash,
            "key_hash": session.key_hash,
            "ended": ended,
            "turns": [[t.interaction_id, None if t.parent is None else index[id(t.parent)]] for t in session.turns],
            "rewards": session.rewards,
            "records": session.trajectory_ids,
        }
        path = self.directory / f"{session.id}.json"
        atomic_write_text(path, json.dumps(state))
        path.chmod(0o600)

    def remove(self, session_id: str) -> None:
        (self.directory / f"{session_id}.json").unlink(missing_ok=True)

    def load(self, grace_s: float) -> list[Session]:
        """The sessions ended less than ``grace_s`` ago (older files are removed; an unreadable one is
        skipped, saying which)."""
        sessions = []
        for path in sorted(self.directory.glob("*.json")):
            if not SESSION_ID.fullmatch(path.stem):
                continue
            try:
                session, ended = restored(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
                log.warning("ended session %s not restored (its late rewards are refused): %s", path, exc)
                continue
            age = time.time() - ended
            if age > grace_s:
                path.unlink(missing_ok=True)
                continue
            session.ended_at = time.monotonic() - age
            sessions.append(session)
        return sessions


def restored(state: dict) -> tuple[Session, float]:
    """(the session of a saved ``state``, with its turns' ids and links only; when it ended, wall-clock)."""
    session = Session(
        tenant=state["tenant"],
        tenant_key_hash=state["tenant_key_hash"],
        key_hash=state["key_hash"],
        id=state["id"],
        rewards={str(k): float(v) for k, v in state["rewards"].items()},
        trajectory_ids={str(k): str(v) for k, v in state["records"].items()},
    )
    for interaction_id, parent in state["turns"]:
        session.turns.append(
            Turn(str(interaction_id), [], [], [], [], "stop", 0.0, None if parent is None else session.turns[parent])
        )
    return session, float(state["ended"])
