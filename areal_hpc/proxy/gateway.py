"""The proxy's state and what it does with it: who a key belongs to, which session a call may act on,
a turn (quota, template-built prompt ids, generation, the turn kept once its reply is sent), ending a
session (its records written once), rewards (late ones as shard events, also after a restart), and
the sweep that ends idle sessions.

The event loop renders and tokenises only small prompts (a few kilobytes: a fraction of a millisecond,
less than handing them to a thread, whose Python would hold the GIL against the loop); larger ones
run on threads (``tokenizers`` releases the GIL), long prompts on one of their own, so a tenant's
megabyte prompts queue behind each other and never in front of other tenants' requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from areal_hpc.proxy import openai_api as api
from areal_hpc.proxy.chat_template import ChatTokenizer, TemplateRenderError
from areal_hpc.proxy.ended import EndedSessions
from areal_hpc.proxy.openai_api import APIError
from areal_hpc.proxy.records import RecordSink
from areal_hpc.proxy.router import BackendRouter
from areal_hpc.proxy.sessions import REWARD_SOURCE, Session, Turn, keep_reply, new_id
from areal_hpc.proxy.tenants import Quota, QuotaMeter, TenantKeys, hash_key, retry_after
from areal_hpc.rollout.client import ConnectionFailedError, NoServerError, ServerReplyError
from areal_hpc.runtime.name_resolve import HEARTBEAT_INTERVAL_S

log = logging.getLogger(__name__)

SMALL_PROMPT_CHARS = 4 << 10  # prompts (characters, or tokens to decode) up to this are done on the event loop
LONG_PROMPT_CHARS = 32 << 10  # longer prompts (tens of milliseconds to tokenise) go to the long-prompt thread


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
    ended_sessions: EndedSessions | None = None  # on disk for the reward grace period (None: memory only)
    long_prompts: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="proxy-long-prompts")
    )
    ended: int = 0

    # -- who is calling ------------------------------------------------------------------------------
    def caller(self, headers) -> tuple[str, Session | None]:
        """(tenant, the session whose key ``headers`` carry, or None for a tenant key)."""
        header = headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(
                401,
                "no API key: send 'Authorization: Bearer <key>' (the openai client's api_key)",
                code="missing_api_key",
            )
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

    def admit_request(self, tenant: str, quota: Quota, tokens: int = 0) -> None:
        """Count a request against the tenant's requests per minute (429 when over), checking that its
        tokens bucket holds ``tokens`` already (what the request will reserve at least)."""
        self._metered(tenant, quota, tokens, self.meter.admit)

    def _metered(self, tenant: str, quota: Quota, tokens: int, take) -> None:
        """``take(tenant, quota, tokens)`` from the tenant's buckets, or a 429: one that no wait admits
        (OpenAI's 'Request too large', without a Retry-After), or one saying how long to wait."""
        if quota.tokens_per_minute and tokens > quota.tokens_per_minute:
            raise APIError(
                429,
                f"request too large for tenant {tenant}'s tokens per minute: limit "
                f"{quota.tokens_per_minute:g}, requested {tokens} (prompt + max_tokens); shorten the "
                "prompt or lower max_tokens",
                code="rate_limit_exceeded",
            )
        wait = take(tenant, quota, tokens)
        if wait:
            raise APIError(
                429,
                f"tenant {tenant} is over its quota; retry in {wait:.1f} s",
                code="rate_limit_exceeded",
                headers={"Retry-After": retry_after(wait)},
            )

    def admit_session(self) -> None:
        """AReaL's staleness gate for sessions: while the trainer at version v takes ``records_per_version``
        proxy records a step, at most ``(max_staleness + v + 1) * records_per_version`` sessions may have
        been opened, or their records would be too stale to train by the time it reaches them."""
        per_version = self.settings.records_per_version
        if not per_version:
            return
        opened = self.ended + sum(1 for s in self.sessions.values() if s.ended_at is None)
        if opened >= (self.settings.max_staleness + self.router.version + 1) * per_version:
            raise APIError(
                429,
                f"the trainer (version {self.router.version}) has no room for another session "
                "yet; retry after its next step",
                code="staleness_capacity",
                headers={"Retry-After": str(int(HEARTBEAT_INTERVAL_S))},
            )

    # -- turns ---------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def turn(
        self,
        session: Session,
        params: dict,
        *,
        prompt: str | list[int] | None = None,
        chat: tuple[list[dict], list[dict] | None, dict] | None = None,
    ):
        """Generate one reply for ``session`` to a prompt (text or token ids) or a chat (messages, tools
        or None, the template's arguments) and yield the turn, kept in the session; the block sends the
        reply. A block that raises (the client left before its reply was sent) takes the turn back out: no
        record holds a reply nobody saw.

        Quota: the request is counted, and its token bucket must hold ``max_tokens`` and a token, before
        any work; the prompt and ``max_tokens`` are reserved once it is tokenised, and what the turn did
        not use is given back when it ends (all of it when nothing was generated)."""
        if session.ended_at is not None:
            raise APIError(409, f"session {session.id} has ended", code="session_ended")
        quota = self.keys.quota(session.tenant)
        self.admit_request(session.tenant, quota, params["max_new_tokens"] + 1)
        self.active[session.id] = self.active.get(session.id, 0) + 1
        self.last_seen[session.id] = time.monotonic()
        reserved = used = 0
        try:
            ids, parent = await self._prompt_ids(session, prompt, chat)
            self._metered(session.tenant, quota, len(ids) + params["max_new_tokens"], self.meter.reserve)
            reserved = len(ids) + params["max_new_tokens"]
            out = await self._generate(session, ids, params)
            used = len(ids) + len(out.output_ids)
            text = await self._sized(len(ids), self.tokenizer.decode_all, ids + out.output_ids)
            turn = Turn(
                new_id("chatcmpl-" if chat is not None else "cmpl-"),
                ids,
                out.output_ids,
                out.logprobs,
                out.versions,
                api.finish_reason(out.finish_reason),
                params["temperature"],
                parent,
                text,
                cached_tokens=out.cached_tokens,
            )
            if chat is not None:
                keep_reply(turn, self.tokenizer, *chat)
            session.turns.append(turn)  # now: a next request the client sends on seeing the reply extends it
            try:
                yield turn
            except BaseException:
                session.turns.remove(turn)  # nobody saw it, so nothing extends it
                raise
        finally:
            self.meter.refund(session.tenant, quota, reserved - used)
            self.active[session.id] -= 1

    async def _prompt_ids(self, session: Session, prompt, chat) -> tuple[list[int], Turn | None]:
        """(the prompt's token ids, the turn it extends): a text prompt extending an earlier turn is that
        turn's exact ids and the tokens of the new text only (sessions.py)."""
        if isinstance(prompt, list):
            return prompt, session.parent_by_ids(prompt)
        typed = []
        if chat is not None:
            messages, tools, template_args = chat
            size = sum(len(m["content"]) for m in messages)
            try:
                prompt, typed = await self._sized(size, self.tokenizer.render_prompt, messages, tools, template_args)
            except TemplateRenderError as exc:
                raise APIError(400, str(exc), param="messages", code="template_error") from None
        parent, bridge, start = session.extension(prompt) or (None, "", 0)
        shift = len(bridge) - start
        new_text = bridge + prompt[start:]
        new_ids = await self._sized(
            len(new_text), self.tokenizer.encode, new_text, [(a + shift, b + shift) for a, b in typed if a >= start]
        )
        return (parent.full_ids if parent is not None else []) + new_ids, parent

    async def _sized(self, size: int, function, *args):
        """``function(*args)``: here when ``size`` (characters or tokens) is small, else on a thread (the
        long-prompt one when it is large)."""
        if size <= SMALL_PROMPT_CHARS:
            return function(*args)
        pool = self.long_prompts if size > LONG_PROMPT_CHARS else None
        return await asyncio.get_running_loop().run_in_executor(pool, function, *args)

    async def _generate(self, session: Session, ids: list[int], params: dict):
        try:
            out = await self.router.generate({"input_ids": ids, "sampling_params": params}, prefer=session.backend)
        except ServerReplyError as exc:
            if exc.status >= 500:
                raise APIError(502, f"the rollout server failed the request: {exc}", code="backend_error") from None
            raise APIError(400, f"the rollout server refused the request: {exc}", code="invalid_request") from None
        except (NoServerError, ConnectionFailedError) as exc:
            raise APIError(503, f"{exc}; try again later", code="no_backend", headers={"Retry-After": "5"}) from None
        session.backend = out.server
        return out

    # -- ending --------------------------------------------------------------------------------------
    async def end(self, session: Session) -> None:
        """Refuse new turns, wait for those in flight, write the session's records (once; a second call
        waits for the first)."""
        if session.id in self.writing:
            return await asyncio.shield(self.writing[session.id])
        if session.ended_at is not None:  # restored: an earlier proxy process wrote its records
            return
        written = self.writing[session.id] = asyncio.get_running_loop().create_future()
        session.ended_at = time.monotonic()
        try:
            while self.active.get(session.id):
                await asyncio.sleep(0.01)
            records = session.trajectories(self.settings.discount) if session.turns else []
            await self.sink.write(records)
            session.trajectory_ids = {leaf.interaction_id: r.id for leaf, r in zip(session.leaves(), records)}
            self.ended += 1
            await self._save_ended(session)
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
        if session.trajectory_ids:
            await self._save_ended(session)

    async def _save_ended(self, session: Session) -> None:
        """Keep ``session`` on disk for late rewards after a restart; a failure to (a full disk) costs only
        that, so it is logged and the records stay written."""
        if self.ended_sessions is None:
            return
        try:
            await asyncio.to_thread(self.ended_sessions.save, session)
        except OSError as exc:
            log.warning(
                "ended session %s not kept on disk (after a restart its late rewards are refused): %s", session.id, exc
            )

    async def restore_ended(self) -> None:
        """Take back the sessions ended within the reward grace period before this proxy started."""
        if self.ended_sessions is None:
            return
        restored = await asyncio.to_thread(self.ended_sessions.load, self.settings.reward_grace_s)
        for session in restored:
            self.sessions.setdefault(session.id, session)
            self.by_key.setdefault(session.key_hash, session)
        log.info("%d ended sessions restored for their late rewards", len(restored))

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
                    if self.ended_sessions is not None:
                        await asyncio.to_thread(self.ended_sessions.remove, session.id)
            if now - probed >= HEARTBEAT_INTERVAL_S:
                await self.router.refresh()
                probed = now
