"""The proxy's HTTP surface on aiohttp: OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` for agents (authenticated by a session key), and ``/rl/*`` to open and end sessions and
give rewards (a tenant key opens a session). Every error is OpenAI's JSON shape and the proxy keeps
serving; records of ended sessions go to the run's shards (records.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field

from aiohttp import web

from areal_hpc.launch.name_resolve import HEARTBEAT_INTERVAL_S

from areal_hpc.proxy import openai_api as api
from areal_hpc.proxy.chat_template import ChatTokenizer, TemplateRenderError
from areal_hpc.proxy.openai_api import APIError
from areal_hpc.proxy.records import RecordSink
from areal_hpc.proxy.router import BackendRouter
from areal_hpc.proxy.sessions import REWARD_SOURCE, Session, Turn, new_id, session_returns
from areal_hpc.proxy.tenants import QuotaMeter, TenantKeys, hash_key, new_key, retry_after
from areal_hpc.rollout.client import ConnectionFailedError, NoServerError, ServerReplyError

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

    # -- turns ---------------------------------------------------------------------------------------
    async def turn(self, session: Session, body: dict, *, text: str | None = None,
                   ids: list[int] | None = None) -> Turn:
        """Generate one reply for ``session`` (prompt as text or as ids) and keep it as a turn."""
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
            parent = session.parent_by_text(text)
            ids = (parent.full_ids + self.tokenizer.encode(text[len(parent.text):]) if parent is not None
                   else self.tokenizer.encode(text))
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
                    out.versions, api.finish_reason(out.finish_reason), parent,
                    self.tokenizer.decode(ids + out.output_ids, skip_special_tokens=False))
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
                if session.ended_at is None and now - self.last_seen.get(session.id, now) > self.settings.session_idle_s:
                    await self.end(session)
                elif session.ended_at is not None and now - session.ended_at > self.settings.reward_grace_s:
                    self.forget(session)
            if now - probed >= HEARTBEAT_INTERVAL_S:
                await self.router.refresh()
                probed = now


PROXY = web.AppKey("proxy", Proxy)


async def read_json(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read()) if request.can_read_body else {}
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise APIError(400, f"the body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def error_response(exc: APIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


@web.middleware
async def errors_as_openai(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc)
    except web.HTTPException as exc:  # aiohttp's own 404, 405, 413
        if exc.status == 413:
            return error_response(APIError(413, f"request body too large ({exc.text})", code="request_too_large"))
        return error_response(APIError(exc.status, f"{exc.reason}: {request.method} {request.path}"))
    except Exception as exc:  # noqa: BLE001 - a bug: say what, keep serving
        log.exception("%s failed", request.path)
        return error_response(APIError(500, f"{type(exc).__name__}: {exc}"))


def check_model(proxy: Proxy, body: dict) -> None:
    model = body.get("model")
    if model != proxy.settings.model_name:
        raise APIError(404, f"model {model!r} is not served here; /v1/models lists {proxy.settings.model_name!r}",
                       param="model", code="model_not_found")


def session_of(proxy: Proxy, request: web.Request) -> Session:
    _, session = proxy.caller(request)
    if session is None:
        raise APIError(403, "completions need a session key: open a session with POST /rl/start_session and "
                       "use its session_key as the api_key", code="session_required")
    return session


async def chat_completions(request: web.Request) -> web.StreamResponse:
    proxy = request.app[PROXY]
    session = session_of(proxy, request)
    body = await read_json(request)
    check_model(proxy, body)
    messages = api.messages_of(body)
    stream = api.flag(body, "stream")
    want_logprobs = api.flag(body, "logprobs")
    try:
        text = proxy.tokenizer.render(messages, body.get("tools"))
    except TemplateRenderError as exc:
        raise APIError(400, str(exc), param="messages", code="template_error") from None
    turn = await proxy.turn(session, body, text=text)
    usage = api.usage(len(turn.prompt_ids), len(turn.output_ids))
    name = proxy.settings.model_name
    if stream:
        pieces = proxy.tokenizer.pieces(turn.output_ids)
        return await send_events(request, api.chat_chunks(turn.interaction_id, name, pieces, turn.finish_reason,
                                                          usage if api.include_usage(body) else None))
    logprobs = (api.logprobs_content(proxy.tokenizer.token_texts(turn.output_ids), turn.logprobs)
                if want_logprobs else None)
    return web.json_response(api.chat_reply(turn.interaction_id, name, proxy.tokenizer.decode(turn.output_ids),
                                            turn.finish_reason, usage, logprobs))


async def completions(request: web.Request) -> web.StreamResponse:
    proxy = request.app[PROXY]
    session = session_of(proxy, request)
    body = await read_json(request)
    check_model(proxy, body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        turn = await proxy.turn(session, body, text=prompt)
    elif isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        turn = await proxy.turn(session, body, ids=prompt)
    else:
        raise api.bad("prompt", prompt, "a non-empty string or list of token ids (one prompt per request)")
    name, text = proxy.settings.model_name, proxy.tokenizer.decode(turn.output_ids)
    if api.flag(body, "stream"):
        pieces = proxy.tokenizer.pieces(turn.output_ids)
        return await send_events(request, api.completion_chunks(turn.interaction_id, name, pieces,
                                                                turn.finish_reason))
    want_logprobs = body.get("logprobs") is not None
    return web.json_response(api.completion_reply(
        turn.interaction_id, name, text, turn.finish_reason, api.usage(len(turn.prompt_ids), len(turn.output_ids)),
        turn.logprobs if want_logprobs else None, proxy.tokenizer.token_texts(turn.output_ids)))


async def send_events(request: web.Request, events) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for event in events:
        await response.write(event)
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    proxy.caller(request)
    return web.json_response({"object": "list", "data": [{"id": proxy.settings.model_name, "object": "model",
                                                          "created": 0, "owned_by": "areal-hpc"}]})


async def start_session(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    tenant, own = proxy.caller(request)
    if own is not None:
        raise APIError(403, "start_session needs a tenant key, not a session key", code="tenant_key_required")
    body = await read_json(request)
    metadata = body.get("metadata", {})
    if not isinstance(metadata, dict):
        raise api.bad("metadata", metadata, "a JSON object (stored with the session's records)")
    key = new_key("sk")
    auth = request.headers["Authorization"].partition(" ")[2].strip()
    session = Session(tenant=tenant, tenant_key_hash=hash_key(auth), key_hash=hash_key(key), metadata=metadata)
    proxy.sessions[session.id] = session
    proxy.by_key[session.key_hash] = session
    proxy.last_seen[session.id] = time.monotonic()
    return web.json_response({"session_id": session.id, "session_key": key, "tenant": tenant})


async def end_session(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    tenant, own = proxy.caller(request)
    body = await read_json(request)
    session = proxy.target(tenant, own, body.get("session_id"))
    await proxy.end(session)
    return web.json_response(summary(proxy, session))


async def set_reward(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    tenant, own = proxy.caller(request)
    body = await read_json(request)
    session = proxy.target(tenant, own, body.get("session_id"))
    value = body.get("reward")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise api.bad("reward", value, "a finite number")
    interaction = body.get("interaction_id")
    if interaction is not None and not isinstance(interaction, str):
        raise api.bad("interaction_id", interaction, "a string (the id of a completion)")
    turn = session.turn(interaction)
    if turn is None:
        if interaction is None:
            raise APIError(400, f"session {session.id} has no interaction to reward yet", param="interaction_id")
        raise APIError(404, f"no interaction {interaction!r} in session {session.id}", param="interaction_id",
                       code="interaction_not_found")
    await proxy.reward(session, turn, float(value))
    return web.json_response({"session_id": session.id, "interaction_id": turn.interaction_id,
                              "reward": float(value), "late": bool(session.trajectory_ids)})


async def get_session(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    tenant, own = proxy.caller(request)
    return web.json_response(summary(proxy, proxy.target(tenant, own, request.match_info["session_id"])))


def summary(proxy: Proxy, session: Session) -> dict:
    discount = proxy.settings.discount
    return {"session_id": session.id, "tenant": session.tenant, "ended": session.ended_at is not None,
            "interactions": [t.interaction_id for t in session.turns],
            "rewards": dict(session.rewards),
            "records": [{"id": session.trajectory_ids.get(leaf.interaction_id),
                         "interaction_ids": [t.interaction_id for t in leaf.chain()],
                         "returns": session_returns(session, leaf, discount)} for leaf in session.leaves()]}


async def health(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    return web.json_response({"status": "ok", "backends": len(proxy.router.healthy), "sessions": len(proxy.sessions),
                              "ended": proxy.ended, "records": proxy.sink.written})


def build_app(proxy: Proxy, max_request_bytes: int) -> web.Application:
    app = web.Application(middlewares=[errors_as_openai], client_max_size=max_request_bytes)
    app[PROXY] = proxy
    app.add_routes([
        web.post("/v1/chat/completions", chat_completions), web.post("/v1/completions", completions),
        web.get("/v1/models", models), web.post("/rl/start_session", start_session),
        web.post("/rl/end_session", end_session), web.post("/rl/set_reward", set_reward),
        web.get("/rl/sessions/{session_id}", get_session), web.get("/health", health),
    ])

    async def lifecycle(app: web.Application):
        await proxy.router.start()
        sweeper = asyncio.create_task(proxy.sweep())
        yield
        sweeper.cancel()
        for session in list(proxy.sessions.values()):  # shutting down: open sessions are written, not lost
            await proxy.end(session)
        await proxy.router.close()
        await asyncio.to_thread(proxy.sink.close)

    app.cleanup_ctx.append(lifecycle)
    return app
