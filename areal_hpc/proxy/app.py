"""The proxy's HTTP surface on aiohttp: OpenAI's ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` for agents (authenticated by a session key), and ``/rl/*`` to open and end sessions and
give rewards (a tenant key opens a session). Every error is OpenAI's JSON shape and the proxy keeps
serving; what the routes do with sessions is in gateway.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

from aiohttp import web

from areal_hpc.proxy import openai_api as api
from areal_hpc.proxy.chat_template import TemplateRenderError
from areal_hpc.proxy.gateway import Proxy
from areal_hpc.proxy.openai_api import APIError
from areal_hpc.proxy.sessions import Session, session_returns
from areal_hpc.proxy.tenants import hash_key, new_key

log = logging.getLogger(__name__)


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
    turn = await proxy.turn(session, body, text=text, messages=messages)
    usage = api.usage(len(turn.prompt_ids), len(turn.output_ids))
    name = proxy.settings.model_name
    if stream:
        calls = turn.reply.get("tool_calls")
        pieces = proxy.tokenizer.pieces(turn.output_ids) if not calls else [turn.reply["content"] or ""]
        return await send_events(request, api.chat_chunks(turn.interaction_id, name, pieces, turn.finish_reason,
                                                          usage if api.include_usage(body) else None, calls))
    logprobs = (api.logprobs_content(proxy.tokenizer.token_texts(turn.output_ids), turn.logprobs)
                if want_logprobs else None)
    return web.json_response(api.chat_reply(turn.interaction_id, name, turn.reply, turn.finish_reason, usage,
                                            logprobs))


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
    proxy.admit_session()
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


def openai_app(proxy: Proxy, max_request_bytes: int) -> web.Application:
    """The routes alone: agent workflows serve them in the trainer's process (``agents.chat``)."""
    app = web.Application(middlewares=[errors_as_openai], client_max_size=max_request_bytes)
    app[PROXY] = proxy
    app.add_routes([
        web.post("/v1/chat/completions", chat_completions), web.post("/v1/completions", completions),
        web.get("/v1/models", models), web.post("/rl/start_session", start_session),
        web.post("/rl/end_session", end_session), web.post("/rl/set_reward", set_reward),
        web.get("/rl/sessions/{session_id}", get_session), web.get("/health", health),
    ])
    return app


def build_app(proxy: Proxy, max_request_bytes: int) -> web.Application:
    """The login-node proxy: the routes, its backends probed, idle sessions swept, records written."""
    app = openai_app(proxy, max_request_bytes)

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
