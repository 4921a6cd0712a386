"""The proxy's HTTP surface on aiohttp: OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` for agents (authenticated by a session key), and ``/rl/*`` to open and end sessions and
give rewards (a tenant key opens a session, counted against its requests per minute). Every error is
OpenAI's JSON shape and the proxy keeps serving; a reply is sent inside its turn, so a client gone by
then leaves no turn behind. What the routes do with sessions is in gateway.py. The two turn routes are
cores apart from aiohttp (``TURN_ROUTES``): agent workflows answer them in their own process too
(``agents.chat``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from aiohttp import web

from areal_hpc.proxy import openai_api as api
from areal_hpc.proxy.gateway import Proxy
from areal_hpc.proxy.openai_api import APIError, check_unicode
from areal_hpc.proxy.sessions import Session, session_returns
from areal_hpc.proxy.tenants import hash_key, new_key

log = logging.getLogger(__name__)


PROXY = web.AppKey("proxy", Proxy)
MAX_METADATA_BYTES = 4096  # a session's metadata, as JSON: it is kept in memory and in each of its records


class ClientLeft(Exception):
    """The client closed its connection before its reply was sent."""


async def read_json(request: web.Request) -> dict:
    return parse_json(await request.read() if request.can_read_body else b"")


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object (none: ``{}``), or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw) if raw else {}
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise APIError(400, f"the body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    check_unicode(raw, body)
    return body


def error_response(exc: APIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


def as_api_error(exc: Exception, path: str) -> APIError:
    """Any other exception of a route is a bug: say what in OpenAI's shape, keep serving."""
    log.error("%s failed", path, exc_info=exc)
    return APIError(500, f"{type(exc).__name__}: {exc}")


@web.middleware
async def errors_as_openai(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc)
    except ClientLeft:
        log.info("%s: the client left before its reply was sent; its turn is dropped", request.path)
        return web.Response(status=499)  # nobody reads it: aiohttp drops it quietly on the closed connection
    except web.HTTPException as exc:  # aiohttp's own 404, 405, 413
        if exc.status == 413:
            return error_response(APIError(413, f"request body too large ({exc.text})", code="request_too_large"))
        return error_response(APIError(exc.status, f"{exc.reason}: {request.method} {request.path}"))
    except Exception as exc:  # noqa: BLE001 - a bug: say what, keep serving
        return error_response(as_api_error(exc, request.path))


def check_model(proxy: Proxy, body: dict) -> None:
    model = body.get("model")
    if model != proxy.settings.model_name:
        raise APIError(
            404,
            f"model {model!r} is not served here; /v1/models lists {proxy.settings.model_name!r}",
            param="model",
            code="model_not_found",
        )


def session_of(proxy: Proxy, headers) -> Session:
    _, session = proxy.caller(headers)
    if session is None:
        raise APIError(
            403,
            "completions need a session key: open a session with POST /rl/start_session and "
            "use its session_key as the api_key",
            code="session_required",
        )
    return session


def params_of(proxy: Proxy, body: dict) -> dict:
    settings = proxy.settings
    return api.sampling_params(
        body, settings.default_max_tokens, settings.max_tokens_cap, proxy.tokenizer.eos_token_ids
    )


@dataclass
class Reply:
    """What a completion route answers, before it is sent: a JSON body, or server-sent events."""

    body: dict | None = None
    events: Iterable[bytes] = ()


@contextlib.asynccontextmanager
async def chat_turn(proxy: Proxy, session: Session, body: dict) -> AsyncIterator[Reply]:
    """``/v1/chat/completions``: one turn of ``session``, kept only if the block that sends the reply
    returns (the same for the completion route below)."""
    check_model(proxy, body)
    chat = api.chat_of(body)
    stream, want_logprobs = api.flag(body, "stream"), api.flag(body, "logprobs")
    async with proxy.turn(session, params_of(proxy, body), chat=chat) as turn:
        usage = api.usage(len(turn.prompt_ids), len(turn.output_ids), turn.cached_tokens)
        name = proxy.settings.model_name
        if stream:
            calls, reasoning = turn.reply.get("tool_calls"), turn.reply.get("reasoning_content")
            parsed = calls or reasoning is not None  # the text the client gets is not the tokens' as they are
            pieces = [turn.reply["content"] or ""] if parsed else proxy.tokenizer.pieces(turn.output_ids)
            yield Reply(
                events=api.chat_chunks(
                    turn.interaction_id,
                    name,
                    pieces,
                    turn.finish_reason,
                    usage if api.include_usage(body) else None,
                    calls,
                    reasoning,
                )
            )
            return
        logprobs = (
            api.logprobs_content(proxy.tokenizer.token_texts(turn.output_ids), turn.logprobs) if want_logprobs else None
        )
        yield Reply(api.chat_reply(turn.interaction_id, name, turn.reply, turn.finish_reason, usage, logprobs))


@contextlib.asynccontextmanager
async def completion_turn(proxy: Proxy, session: Session, body: dict) -> AsyncIterator[Reply]:
    """``/v1/completions``: a prompt of text or token ids."""
    check_model(proxy, body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if not (
        (isinstance(prompt, str) and prompt)
        or (isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt))
    ):
        raise api.bad("prompt", prompt, "a non-empty string or list of token ids (one prompt per request)")
    want_logprobs = api.number(body, "logprobs", None, 0, 5, integer=True) is not None
    stream = api.flag(body, "stream")
    api.check_common(body)
    async with proxy.turn(session, params_of(proxy, body), prompt=prompt) as turn:
        name = proxy.settings.model_name
        if stream:
            pieces = proxy.tokenizer.pieces(turn.output_ids)
            yield Reply(events=api.completion_chunks(turn.interaction_id, name, pieces, turn.finish_reason))
            return
        yield Reply(
            api.completion_reply(
                turn.interaction_id,
                name,
                proxy.tokenizer.decode(turn.output_ids),
                turn.finish_reason,
                api.usage(len(turn.prompt_ids), len(turn.output_ids), turn.cached_tokens),
                turn.logprobs if want_logprobs else None,
                proxy.tokenizer.token_texts(turn.output_ids),
            )
        )


TURN_ROUTES = {"/v1/chat/completions": chat_turn, "/v1/completions": completion_turn}


def turn_handler(route):
    """The aiohttp handler of a turn route: the key checked before the body is read, the reply sent
    from inside the turn."""

    async def handler(request: web.Request) -> web.StreamResponse:
        proxy = request.app[PROXY]
        session = session_of(proxy, request.headers)
        body = await read_json(request)
        async with route(proxy, session, body) as reply:
            if reply.body is not None:
                return await send(request, web.json_response(reply.body))
            return await send_events(request, reply.events)

    return handler


async def send(request: web.Request, response: web.StreamResponse, events=()) -> web.StreamResponse:
    """Send ``response`` (then ``events``) now, from inside the turn, which is kept only if this returns:
    a client that has left raises ``ClientLeft``."""
    try:
        if request.transport is None or request.transport.is_closing():
            raise ConnectionResetError("the connection is closed")
        await response.prepare(request)
        for event in events:
            await response.write(event)
        await response.write_eof()
    except ConnectionError as exc:
        raise ClientLeft(str(exc)) from None
    return response


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def send_events(request: web.Request, events) -> web.StreamResponse:
    return await send(request, web.StreamResponse(headers=SSE_HEADERS), events)


async def models(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    proxy.caller(request.headers)
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": proxy.settings.model_name, "object": "model", "created": 0, "owned_by": "areal-hpc"}],
        }
    )


async def start_session(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    tenant, own = proxy.caller(request.headers)
    if own is not None:
        raise APIError(403, "start_session needs a tenant key, not a session key", code="tenant_key_required")
    body = await read_json(request)
    metadata = body.get("metadata", {})
    if not isinstance(metadata, dict):
        raise api.bad("metadata", metadata, "a JSON object (stored with the session's records)", "invalid_type")
    size = len(json.dumps(metadata).encode())
    if size > MAX_METADATA_BYTES:
        raise api.bad(
            "metadata",
            metadata,
            f"a JSON object of at most {MAX_METADATA_BYTES} bytes as JSON, not "
            f"{size} (stored with each of the session's records)",
        )
    proxy.admit_request(tenant, proxy.keys.quota(tenant))
    proxy.admit_session()
    key = new_key("sk")
    auth = request.headers["Authorization"].partition(" ")[2].strip()
    session = Session(tenant=tenant, tenant_key_hash=hash_key(auth), key_hash=hash_key(key), metadata=metadata)
    proxy.sessions[session.id] = session
    proxy.by_key[session.key_hash] = session
    proxy.last_seen[session.id] = time.monotonic()
    return web.json_response({"session_id": session.id, "session_key": key, "tenant": tenant})


async def end_session(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    tenant, own = proxy.caller(request.headers)
    body = await read_json(request)
    session = proxy.target(tenant, own, body.get("session_id"))
    await proxy.end(session)
    return web.json_response(summary(proxy, session))


async def set_reward(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    tenant, own = proxy.caller(request.headers)
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
        raise APIError(
            404,
            f"no interaction {interaction!r} in session {session.id}",
            param="interaction_id",
            code="interaction_not_found",
        )
    await proxy.reward(session, turn, float(value))
    return web.json_response(
        {
            "session_id": session.id,
            "interaction_id": turn.interaction_id,
            "reward": float(value),
            "late": bool(session.trajectory_ids),
        }
    )


async def get_session(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    tenant, own = proxy.caller(request.headers)
    return web.json_response(summary(proxy, proxy.target(tenant, own, request.match_info["session_id"])))


def summary(proxy: Proxy, session: Session) -> dict:
    discount = proxy.settings.discount
    return {
        "session_id": session.id,
        "tenant": session.tenant,
        "ended": session.ended_at is not None,
        "interactions": [t.interaction_id for t in session.turns],
        "rewards": dict(session.rewards),
        "records": [
            {
                "id": session.trajectory_ids.get(leaf.interaction_id),
                "interaction_ids": [t.interaction_id for t in leaf.chain()],
                "returns": session_returns(session, leaf, discount),
            }
            for leaf in session.leaves()
        ],
    }


async def health(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    return web.json_response(
        {
            "status": "ok",
            "backends": len(proxy.router.healthy),
            "sessions": len(proxy.sessions),
            "ended": proxy.ended,
            "records": proxy.sink.written,
        }
    )


def build_app(proxy: Proxy, max_request_bytes: int) -> web.Application:
    """The login-node proxy: the routes, its backends probed, idle sessions swept, records written, the
    sessions ended within the reward grace period before it started taken back for their late rewards.
    (Agent workflows answer the turn routes in their own process: ``agents.chat``.)"""
    app = web.Application(middlewares=[errors_as_openai], client_max_size=max_request_bytes)
    app[PROXY] = proxy
    app.add_routes(
        [
            *(web.post(path, turn_handler(route)) for path, route in TURN_ROUTES.items()),
            web.get("/v1/models", models),
            web.post("/rl/start_session", start_session),
            web.post("/rl/end_session", end_session),
            web.post("/rl/set_reward", set_reward),
            web.get("/rl/sessions/{session_id}", get_session),
            web.get("/health", health),
        ]
    )

    async def lifecycle(app: web.Application):
        await proxy.restore_ended()
        await proxy.router.start()
        sweeper = asyncio.create_task(proxy.sweep())
        yield
        sweeper.cancel()
        for session in list(proxy.sessions.values()):  # shutting down: open sessions are written, not lost
            await proxy.end(session)
        await proxy.router.close()
        await asyncio.to_thread(proxy.sink.close)
        proxy.long_prompts.shutdown()

    app.cleanup_ctx.append(lifecycle)
    return app
