"""The proxy's state and what it does with it: who a key belongs to, which session a call may act on,
a turn (quota, template-built prompt ids, generation, the kept turn), ending a session (its records
written once), rewards (late ones as shard events), and the sweep that ends idle sessions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiohttp import web

from areal_hpc.proxy import openai_api as api
from areal_hpc.proxy.chat_template import ChatTokenizer
from areal_hpc.proxy.openai_api import APIError
from areal_hpc.proxy.records import RecordSink
from areal_hpc.proxy.router import BackendRouter
from areal_hpc.proxy.sessions import REWARD_SOURCE, Session, Turn, keep_reply, new_id
from areal_hpc.proxy.tenants import QuotaMeter, TenantKeys, hash_key, retry_after
from areal_hpc.rollout.client import ConnectionFailedError, NoServerError, ServerReplyError
from areal_hpc.runtime.name_resolve import HEARTBEAT_INTERVAL_S

log = logging.getLogger(__name__)


@dataclass
class ProxySettings:
    model_name: str
    default_max_tokens: int = 256
    max_tokens_cap: int = 4096
    discount: float = 1.0
    reward_grace_s: float = 300.0  # after end_session, rewards are taken (as late rewards) this long
    session_idle_s: float = 3600.0  # a session without a request this long is ended (and written)
    sweep_interval_s: float = 1.0
    records_per_version: int = 0  # the trainer's rl.proxy_records_per_step; 0: sessions are not limited
    max_staleness: int = 2  # the trainer's rollout.max_head_offpolicyness


@dataclass
class Proxy:
    """Everything the routes share: one per proxy process."""

    settings: ProxySettings
    tokenizer: ChatTokenizer
    keys: TenantKeys
    router: BackendRouter
    sink: RecordSink
    meter: QuotaMeter = field(default_factory=QuotaMeter)
    sessions: dict[str, Session] = field(default_factory=dict)
    by_key: dict[str, Session] = field(default_factory=dict)  # session key hash -> session
    active: dict[str, int] = field(default_factory=dict)  # session id -> turns in flight
    last_seen: dict[str, float] = field(default_factory=dict)  # session id -> monotonic time of its last request
    writing: dict[str, asyncio.Future] = field(default_factory=dict)  # session id -> its records written
    ended: int = 0

    # -- who is calling ------------------------------------------------------------------------------
    def caller(self, request: web.Request) -> tuple[str, Session | None]:
        """(tenant, the session whose key was given, or None for a tenant key)."""
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "no API key: send 'Authorization: Bearer <key>' (the openai client's api_key)",
                           code="missing_api_key")
        self._reload_keys()
        key_hash = hash_key(key.strip())
        session = self.by_key.get(key_hash)
        if session is not None:
            if self.keys.tenant(session.tenant_key_hash) != session.tenant:
                raise APIError(401, "the tenant key that opened this session was revoked", code="invalid_api_key")
            return session.tenant, session
        tenant = self.keys.tenant(key_hash)
        if tenant is None:
            raise APIError(401, "invalid or revoked API key", code="invalid_api_key")
        return tenant, None

    def _reload_keys(self) -> None:
        try:
            self.keys.reload()
        except Exception as exc:  # noqa: BLE001 - a half-edited keys file: keep the keys we had, say why
            log.warning("keys file not reloaded, keeping the previous keys: %s", exc)

    def target(self, tenant: str, own: Session | None, session_id) -> Session:
        """The session a ``/rl`` call acts on: a session key acts on its own session only; a tenant key on
        any of its tenant's sessions; another tenant's session is 404 (its existence is not revealed)."""
        if session_id is None:
            if own is None:
                raise APIError(400, "session_id is required with a tenant key", param="session_id")
            return own
        if not isinstance(session_id, str):
            raise api.bad("session_id", session_id, "a string")
        session = self.sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
        if own is not None and session is not own:
            raise APIError(403, "a session key acts on its own session only", param="session_id")
        return session

    def admit_session(self) -> None:
        """AReaL's staleness gate for sessions: while the trainer at version v takes ``records_per_version``
        proxy records a step, at most ``(max_staleness + v + 1) * records_per_version`` sessions may have
        been opened, or their records would be too stale to train by the time it reaches them."""
        per_version = self.settings.records_per_version
        if not per_version:
            return
        opened = self.ended + sum(1 for s in self.sessions.values() if s.ended_at is None)
        if opened >= (self.settings.max_staleness + self.router.version + 1) * per_version:
            raise APIError(429, f"the trainer (version {self.router.version}) has no room for another session "
                           "yet; retry after its next step", code="staleness_capacity",
                           headers={"Retry-After": str(int(HEARTBEAT_INTERVAL_S))})

    # -- turns ---------------------------------------------------------------------------------------
    async def turn(self, session: Session, body: dict, *, text: str | None = None, ids: list[int] | None = None,
                   messages: list[dict] | None = None) -> Turn:
        """Generate one reply for ``session`` (prompt as text, rendered from ``messages`` for a chat, or as
        ids) and keep it as a turn."""
        if session.ended_at is not None:
            raise APIError(409, f"session {session.id} has ended", code="session_ended")
        quota = self.keys.quota(session.tenant)
        wait = self.meter.admit(session.tenant, quota)
        if wait:
            raise APIError(429, f"tenant {session.tenant} is over its quota; retry in {wait:.1f} s",
                           code="rate_limit_exceeded", headers={"Retry-After": retry_after(wait)})
        params = api.sampling_params(body, self.settings.default_max_tokens, self.settings.max_tokens_cap,
                                     self.tokenizer.eos_token_ids)
        if text is not None:
            parent, new_text = session.extension(text) or (None, text)
            ids = (parent.full_ids if parent is not None else []) + self.tokenizer.encode(new_text)
        else:
            parent = session.parent_by_ids(ids)
        self.active[session.id] = self.active.get(session.id, 0) + 1
        self.last_seen[session.id] = time.monotonic()
        try:
            out = await self.router.generate({"input_ids": ids, "sampling_params": params}, prefer=session.backend)
        except ServerReplyError as exc:
            if exc.status >= 500:
                raise APIError(502, f"the rollout server failed the request: {exc}", code="backend_error") from None
            raise APIError(400, f"the rollout server refused the request: {exc}", code="invalid_request") from None
        except (NoServerError, ConnectionFailedError) as exc:
            raise APIError(503, f"{exc}; try again later", code="no_backend", headers={"Retry-After": "5"}) from None
        finally:
            self.active[session.id] -= 1
        session.backend = out.server
        turn = Turn(new_id("chatcmpl-" if "messages" in body else "cmpl-"), ids, out.output_ids, out.logprobs,
                    out.versions, api.finish_reason(out.finish_reason), params["temperature"], parent,
                    self.tokenizer.decode(ids + out.output_ids, skip_special_tokens=False))
        if messages is not None:
            keep_reply(turn, self.tokenizer, messages, body.get("tools"))
        session.turns.append(turn)
        self.meter.charge(session.tenant, quota, len(ids) + len(out.output_ids))
        return turn

    # -- ending --------------------------------------------------------------------------------------
    async def end(self, session: Session) -> None:
        """Refuse new turns, wait for those in flight, write the session's records (once; a second call
        waits for the first)."""
        if session.id in self.writing:
            return await asyncio.shield(self.writing[session.id])
        written = self.writing[session.id] = asyncio.get_running_loop().create_future()
        session.ended_at = time.monotonic()
        try:
            while self.active.get(session.id):
                await asyncio.sleep(0.01)
            records = session.trajectories(self.settings.discount) if session.turns else []
            await self.sink.write(records)
            session.trajectory_ids = {leaf.interaction_id: r.id for leaf, r in zip(session.leaves(), records)}
            self.ended += 1
        except BaseException:  # not written (a full disk...): the session stays open, ending it again retries
            session.ended_at = None
            del self.writing[session.id]
            raise
        finally:
            written.set_result(None)

    async def reward(self, session: Session, turn: Turn, value: float) -> None:
        """Bind ``value`` to ``turn``: in the records when they are written, or, once they are, as a late
        reward event in the shards (a reward arriving while they are written waits for them)."""
        if session.id in self.writing:
            await asyncio.shield(self.writing[session.id])
        session.rewards[turn.interaction_id] = value
        for record, step in session.chains_holding(turn):  # already written: a late reward event
            await self.sink.reward(record, value, step, REWARD_SOURCE)

    def forget(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        self.by_key.pop(session.key_hash, None)
        self.active.pop(session.id, None)
        self.last_seen.pop(session.id, None)
        self.writing.pop(session.id, None)

    async def sweep(self) -> None:
        """Forever: end idle sessions (their records are written), forget ended ones past the reward grace,
        re-probe the rollout servers (as often as name-resolve heartbeats)."""
        probed = time.monotonic()
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                idle = now - self.last_seen.get(session.id, now)
                if session.ended_at is None and idle > self.settings.session_idle_s:
                    await self.end(session)
                elif session.ended_at is not None and now - session.ended_at > self.settings.reward_grace_s:
                    self.forget(session)
            if now - probed >= HEARTBEAT_INTERVAL_S:
                await self.router.refresh()
                probed = now
