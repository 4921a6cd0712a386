"""Chat for agent workflows: the login-node proxy's own turn routes (one implementation: template
rendering, tool-call parsing, turns linked token for token), answered inside the process that runs the
episodes, over the run's rollout client. Each ``client()`` is an ``openai.AsyncOpenAI`` with its own
session; its records are the session's conversations (``Session.trajectories``), returned to the
episode instead of written by a proxy. ``base_url()`` serves the same routes (and ``/rl/set_reward``) over
HTTP on loopback, for agent programs in a process of their own: a client's ``api_key`` is its session's key
there too.

An episode's session (``EpisodeContext.openai_client``) samples as the episode does where a request
does not say otherwise, whichever way it comes: ``max_tokens``, ``temperature`` and ``top_p`` default to the
run's ``generation`` settings, and an episode that decodes greedily (an evaluation) decodes every turn greedily.

In the process, nothing goes over a socket. A plain ``chat.completions.create`` or ``completions.create``
(what agents and the Agents SDK call) hands the routes the JSON body the SDK would have sent and builds the
reply object as the SDK builds it, without the SDK's request machinery (its parameter transform and HTTP
client were 80% of a turn's client CPU: bench/results/agent_workflow_overhead.md). Anything else
(streams, ``with_raw_response``, ``extra_query``, other routes) takes the SDK's own path through an
in-process HTTP transport to the same routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import json
import time
from collections.abc import Iterable
from pathlib import Path

import openai
import pydantic
from aiohttp import web
from openai.resources.chat import AsyncChat
from openai.resources.chat.completions import AsyncCompletions as AsyncChatCompletions
from openai.resources.completions import AsyncCompletions
from openai.types import Completion
from openai.types.chat import ChatCompletion

from areal_hpc.algo.temperature import is_greedy
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.errors import UserError
from areal_hpc.proxy.app import (
    PROXY,
    SSE_HEADERS,
    TURN_ROUTES,
    as_api_error,
    errors_as_openai,
    parse_json,
    session_of,
    set_reward,
)
from areal_hpc.proxy.chat_template import ChatTokenizer
from areal_hpc.proxy.gateway import Proxy, ProxySettings
from areal_hpc.proxy.openai_api import APIError
from areal_hpc.proxy.sessions import Session
from areal_hpc.proxy.tenants import Quota, hash_key, new_key
from areal_hpc.runtime.name_resolve import bind

TENANT = "default"
UNLIMITED = Quota(0, 0)
BASE_URL = "http://episode-chat/v1"  # resolved by no one: the transport answers every request itself
# the HTTP library this ``openai`` release is built on (httpx; httpx2 in the 3.x releases)
HTTPX = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.partition(".")[0])
UNSET = tuple(getattr(openai, name) for name in ("NotGiven", "Omit") if hasattr(openai, name))  # the SDK drops these
RAW_RESPONSE_HEADER = "X-Stainless-Raw-Response"  # set by with_raw_response / with_streaming_response
LOOPBACK_MAX_REQUEST_BYTES = 1 << 28  # an agent program's whole conversation, however long it grew


class EpisodeKeys:
    """The keys of the gateway's one tenant: only sessions it opened itself are let in."""

    def __init__(self):
        self.tenant_key_hash = hash_key(new_key("sk"))

    def reload(self) -> None:
        """Nothing to re-read: the keys live in memory."""

    def tenant(self, key_hash: str) -> str | None:
        return TENANT if key_hash == self.tenant_key_hash else None

    def quota(self, tenant: str) -> Quota:
        return UNLIMITED


class ClientRouter:
    """The proxy's router over a ``generate`` the caller owns (the run's rollout client)."""

    def __init__(self, generate):
        self._generate, self.version, self.healthy = generate, 0, ["run"]

    async def generate(self, body: dict, prefer: str | None):
        return await self._generate(body["input_ids"], body["sampling_params"])

    async def refresh(self) -> None:
        """The rollout client keeps its own servers."""


class InProcessTransport(HTTPX.AsyncBaseTransport):
    """The ``openai`` client's HTTP library answered by the proxy's turn routes in this process, as the
    proxy answers them (the session key checked first, errors in OpenAI's JSON shape); a request
    cancelled before its reply takes its turn back out. A session with sampling defaults (``sampling``:
    session id -> ``agents.engine.Sampling``) has them filled into every request (``with_sampling``)."""

    def __init__(self, proxy: Proxy):
        self.proxy = proxy
        self.sampling: dict[str, object] = {}

    async def handle_async_request(self, request):
        status, content, headers = await self.respond(request.method, request.url.path, request.headers, request.aread)
        if isinstance(content, bytes):
            return HTTPX.Response(status, headers=SSE_HEADERS, content=content)
        return HTTPX.Response(status, json=content, headers=headers)

    async def respond(self, method: str, path: str, headers, read_body) -> tuple[int, dict | bytes, dict | None]:
        """(status, the JSON reply or a stream's events, headers) of a request to ``path``; ``read_body()``
        gives its body, read only once the session key has been checked."""
        try:
            route = TURN_ROUTES.get(path) if method == "POST" else None
            if route is None:
                raise APIError(404, f"Not Found: {method} {path} (an episode's client has {' and '.join(TURN_ROUTES)})")
            session = session_of(self.proxy, headers)
            body = parse_json(await read_body())
            if session.id in self.sampling:
                body = with_sampling(body, self.sampling[session.id])
            async with route(self.proxy, session, body) as reply:
                return 200, (reply.body if reply.body is not None else b"".join(reply.events)), None
        except APIError as exc:
            return exc.status, exc.body(), exc.headers
        except Exception as exc:  # noqa: BLE001 - a bug: answered as the proxy answers it
            error = as_api_error(exc, path)
            return error.status, error.body(), None


def with_sampling(params: dict, sampling) -> dict:
    """A request's parameters with an episode's ``sampling`` (``agents.engine.Sampling``) where they give
    none (absent, None or the SDK's unset marker): ``max_tokens``, ``temperature``, ``top_p``.
    When the episode decodes greedily, so does every request, whatever it asks."""
    filled = dict(params)

    def unset(name: str) -> bool:
        return filled.get(name) is None or isinstance(filled[name], UNSET)

    if unset("max_tokens") and unset("max_completion_tokens"):
        filled["max_tokens"] = sampling.max_new_tokens
    for name, value in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        if unset(name):
            filled[name] = value
    if is_greedy(sampling.temperature):
        filled["temperature"] = 0.0
        extra = filled.get("extra_body")
        if isinstance(extra, dict) and "temperature" in extra:
            filled["extra_body"] = {**extra, "temperature": 0.0}
    return filled


def json_body(params: dict) -> bytes:
    """The body the SDK sends for ``create(**params)``: unset parameters left out, ``extra_body`` merged
    over the rest, models dumped and iterables listed as its transform does them."""
    body = {name: value for name, value in params.items() if not isinstance(value, UNSET)}
    body.update(body.pop("extra_body", None) or {})
    for name in ("extra_headers", "timeout"):
        body.pop(name, None)
    return json.dumps(body, default=_as_json).encode()


def _as_json(value):
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(exclude_unset=True, mode="json", exclude=getattr(value, "__api_exclude__", None))
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class InProcessCreate:
    """``create`` of a completion resource of the recording client: a plain request (not streamed, not
    raw, no ``extra_query``) answered by the route straight away, the reply built as the SDK builds it
    (``construct``'s result), errors raised as the SDK raises them; any other request takes the SDK's own path."""

    PATH: str
    REPLY: type

    async def create(self, **params):
        client = self._client
        if (
            params.get("stream") is True
            or params.get("extra_query")
            or RAW_RESPONSE_HEADER in (params.get("extra_headers") or {})
        ):
            return await super().create(**params)
        body = json_body(params)

        async def read_body() -> bytes:
            return body

        status, content, headers = await client.gateway.transport.respond(
            "POST", self.PATH, {"Authorization": f"Bearer {client.api_key}"}, read_body
        )
        if status != 200:  # the exception the SDK raises for this status and body (its own mapping)
            request = HTTPX.Request("POST", f"{BASE_URL}{self.PATH[len('/v1') :]}")
            raise client._make_status_error_from_response(
                HTTPX.Response(status, json=content, headers=headers, request=request)
            )
        try:  # equal to what ``construct`` (the SDK's lenient build) makes of a valid reply: 3 us, not 50
            return self.REPLY.model_validate(content)
        except pydantic.ValidationError:
            return self.REPLY.construct(**content)


class RecordedChatCompletions(InProcessCreate, AsyncChatCompletions):
    PATH, REPLY = "/v1/chat/completions", ChatCompletion


class RecordedCompletions(InProcessCreate, AsyncCompletions):
    PATH, REPLY = "/v1/completions", Completion


class RecordedChat(AsyncChat):
    @functools.cached_property
    def completions(self) -> RecordedChatCompletions:
        return RecordedChatCompletions(self._client)


class RecordingOpenAI(openai.AsyncOpenAI):
    """An ``openai.AsyncOpenAI`` whose turns are recorded in its session; ``set_reward`` binds a reward
    to a turn (default: the latest), ``records()`` are the session's conversations. ``with_options``
    (``copy``) gives a client of the same session."""

    def __init__(self, *, gateway: ChatGateway, session: Session, **options):
        super().__init__(**options)
        self.gateway, self.session = gateway, session

    def copy(self, **options) -> RecordingOpenAI:
        extra = {**options.pop("_extra_kwargs", {}), "gateway": self.gateway, "session": self.session}
        return super().copy(**options, _extra_kwargs=extra)

    with_options = copy

    @functools.cached_property
    def chat(self) -> RecordedChat:
        return RecordedChat(self)

    @functools.cached_property
    def completions(self) -> RecordedCompletions:
        return RecordedCompletions(self)

    def set_reward(self, value: float, interaction_id: str | None = None) -> None:
        turn = self.session.turn(interaction_id)
        if turn is None:
            raise ValueError(f"no turn {interaction_id!r} to reward in this episode's chat session")
        self.session.rewards[turn.interaction_id] = float(value)

    def records(self) -> list[Trajectory]:
        return self.gateway.close_session(self.session)


class ChatGateway:
    """``async with ChatGateway(generate, model_folder) as chat``: ``chat.client(metadata)`` per episode."""

    def __init__(
        self,
        generate,
        model_folder: str | Path,
        discount: float = 1.0,
        max_tokens_cap: int = 4096,
        default_max_tokens: int = 256,
    ):
        settings = ProxySettings(
            model_name=Path(model_folder).name,
            default_max_tokens=default_max_tokens,
            max_tokens_cap=max_tokens_cap,
            discount=discount,
        )
        self.keys = EpisodeKeys()
        self.proxy = Proxy(settings, ChatTokenizer(model_folder), self.keys, ClientRouter(generate), sink=None)
        self.model_name, self.discount = settings.model_name, discount
        self.transport = InProcessTransport(self.proxy)
        self.http = None
        self.loopback: tuple[web.AppRunner, str] | None = None  # the HTTP server and its base URL, once asked for
        self._starting = asyncio.Lock()

    async def __aenter__(self) -> ChatGateway:
        # one HTTP client for every episode's openai client
        self.http = openai.DefaultAsyncHttpxClient(transport=self.transport)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()
        if self.loopback is not None:
            await self.loopback[0].cleanup()

    async def base_url(self) -> str:
        """The routes over HTTP on loopback (``http://127.0.0.1:PORT/v1``), and the proxy's ``/rl/set_reward``
        beside them, started on the first call and stopped with the gateway: where an agent program in its own
        process sends a client's requests, with that client's ``api_key``."""
        async with self._starting:
            if self.loopback is None:
                self.loopback = await self._serve()
        return self.loopback[1]

    async def _serve(self) -> tuple[web.AppRunner, str]:
        async def answer(request: web.Request) -> web.Response:
            status, content, headers = await self.transport.respond(
                request.method, request.path, request.headers, request.read
            )
            if isinstance(content, bytes):
                return web.Response(status=status, body=content, headers=SSE_HEADERS)
            return web.json_response(content, status=status, headers=headers)

        app = web.Application(middlewares=[errors_as_openai], client_max_size=LOOPBACK_MAX_REQUEST_BYTES)
        app[PROXY] = self.proxy
        app.router.add_post("/rl/set_reward", set_reward)  # the proxy's own: a program may reward its turns itself
        app.router.add_route("*", "/{path:.*}", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = bind("127.0.0.1", 0)
        await web.SockSite(runner, sock).start()
        return runner, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"

    def client(self, metadata: dict, sampling=None) -> RecordingOpenAI:
        """A client of a new session; ``sampling``: its requests' defaults (``with_sampling``), whether they
        come from this client or, over ``base_url()``, from another process with its ``api_key``."""
        key = new_key("sk")
        session = Session(
            tenant=TENANT, tenant_key_hash=self.keys.tenant_key_hash, key_hash=hash_key(key), metadata=dict(metadata)
        )
        self.proxy.sessions[session.id] = session
        self.proxy.by_key[session.key_hash] = session
        self.proxy.last_seen[session.id] = time.monotonic()
        if sampling is not None:
            self.transport.sampling[session.id] = sampling
        return RecordingOpenAI(
            gateway=self,
            session=session,
            api_key=key,
            base_url=BASE_URL,
            http_client=self.http,
            max_retries=0,
        )

    def close_session(self, session: Session) -> list[Trajectory]:
        """The session's records (one per conversation); it takes no more turns."""
        session.ended_at = time.monotonic()
        self.proxy.forget(session)
        self.transport.sampling.pop(session.id, None)
        return session.trajectories(self.discount) if session.turns else []


class NoChat:
    """Where no gateway could start (a model folder without a chat template): workflows that chat are
    told why, the others run all the same."""

    model_name = ""

    def __init__(self, reason: str):
        self.reason = reason

    def client(self, metadata: dict, sampling=None):
        raise UserError(f"this run serves no OpenAI client to its workflow: {self.reason}")

    async def base_url(self) -> str:
        raise UserError(f"this run serves no OpenAI API to its workflow: {self.reason}")


@contextlib.asynccontextmanager
async def optional_chat(generate, model_folder, discount: float):
    """A chat gateway for the workflows' OpenAI clients, or a ``NoChat`` saying why there is none (no
    model folder, or no chat template in it): workflows that do not chat run all the same."""
    if model_folder is None:
        yield NoChat("no model folder to read the tokenizer and chat template from")
        return
    try:
        gateway = ChatGateway(generate, model_folder, discount)
    except UserError as exc:
        yield NoChat(str(exc))
        return
    async with gateway:
        yield gateway
