"""Chat for agent workflows: the login-node proxy's own turn routes (one implementation: template
rendering, tool-call parsing, turns linked token for token), answered inside the process that runs the
episodes, over the run's rollout client. Each ``client()`` is an ``openai.AsyncOpenAI`` with its own
session; its records are the session's conversations (``Session.trajectories``), returned to the
episode instead of written by a proxy. The clients' requests reach the routes through an in-process
transport, not a socket: no HTTP on either side and no connection pool (whose check of every open
connection on every request was 18% of the client's CPU: bench/results/agent_workflow_overhead.md).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from pathlib import Path

import openai

from areal_hpc.data.trajectory import Trajectory
from areal_hpc.errors import UserError
from areal_hpc.proxy.app import (
    SSE_HEADERS,
    TURN_ROUTES,
    as_api_error,
    parse_json,
    session_of,
)
from areal_hpc.proxy.chat_template import ChatTokenizer
from areal_hpc.proxy.gateway import Proxy, ProxySettings
from areal_hpc.proxy.openai_api import APIError
from areal_hpc.proxy.sessions import Session
from areal_hpc.proxy.tenants import Quota, hash_key, new_key

TENANT = "default"
UNLIMITED = Quota(0, 0)
BASE_URL = "http://episode-chat/v1"  # resolved by no one: the transport answers every request itself
# the HTTP library this ``openai`` release is built on (httpx; httpx2 in the 3.x releases)
HTTPX = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.partition(".")[0])


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
    cancelled before its reply takes its turn back out."""

    def __init__(self, proxy: Proxy):
        self.proxy = proxy

    async def handle_async_request(self, request):
        path = request.url.path
        try:
            route = TURN_ROUTES.get(path) if request.method == "POST" else None
            if route is None:
                raise APIError(404, f"Not Found: {request.method} {path} (an episode's client has "
                               f"{' and '.join(TURN_ROUTES)})")
            session = session_of(self.proxy, request.headers)
            body = parse_json(await request.aread())
            async with route(self.proxy, session, body) as reply:
                if reply.body is not None:
                    return HTTPX.Response(200, json=reply.body)
                return HTTPX.Response(200, headers=SSE_HEADERS, content=b"".join(reply.events))
        except APIError as exc:
            return HTTPX.Response(exc.status, json=exc.body(), headers=exc.headers)
        except Exception as exc:  # noqa: BLE001 - a bug: answered as the proxy answers it
            error = as_api_error(exc, path)
            return HTTPX.Response(error.status, json=error.body())


class RecordingOpenAI(openai.AsyncOpenAI):
    """An ``openai.AsyncOpenAI`` whose turns are recorded in its session; ``set_reward`` binds a reward
    to a turn (default: the latest), ``records()`` are the session's conversations."""

    def __init__(self, gateway: "ChatGateway", session: Session, key: str):
        super().__init__(api_key=key, base_url=BASE_URL, http_client=gateway.http, max_retries=0)
        self.gateway, self.session = gateway, session

    def set_reward(self, value: float, interaction_id: str | None = None) -> None:
        turn = self.session.turn(interaction_id)
        if turn is None:
            raise ValueError(f"no turn {interaction_id!r} to reward in this episode's chat session")
        self.session.rewards[turn.interaction_id] = float(value)

    def records(self) -> list[Trajectory]:
        return self.gateway.close_session(self.session)


class ChatGateway:
    """``async with ChatGateway(generate, model_folder) as chat``: ``chat.client(metadata)`` per episode."""

    def __init__(self, generate, model_folder: str | Path, discount: float = 1.0, max_tokens_cap: int = 4096,
                 default_max_tokens: int = 256):
        settings = ProxySettings(model_name=Path(model_folder).name, default_max_tokens=default_max_tokens,
                                 max_tokens_cap=max_tokens_cap, discount=discount)
        self.keys = EpisodeKeys()
        self.proxy = Proxy(settings, ChatTokenizer(model_folder), self.keys, ClientRouter(generate), sink=None)
        self.model_name, self.discount = settings.model_name, discount
        self.http = None

    async def __aenter__(self) -> "ChatGateway":
        # one HTTP client for every episode's openai client
        self.http = openai.DefaultAsyncHttpxClient(transport=InProcessTransport(self.proxy))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    def client(self, metadata: dict) -> RecordingOpenAI:
        key = new_key("sk")
        session = Session(tenant=TENANT, tenant_key_hash=self.keys.tenant_key_hash, key_hash=hash_key(key),
                          metadata=dict(metadata))
        self.proxy.sessions[session.id] = session
        self.proxy.by_key[session.key_hash] = session
        self.proxy.last_seen[session.id] = time.monotonic()
        return RecordingOpenAI(self, session, key)

    def close_session(self, session: Session) -> list[Trajectory]:
        """The session's records (one per conversation); it takes no more turns."""
        session.ended_at = time.monotonic()
        self.proxy.forget(session)
        return session.trajectories(self.discount) if session.turns else []


class NoChat:
    """Where no gateway could start (a model folder without a chat template): workflows that chat are
    told why, the others run all the same."""

    model_name = ""

    def __init__(self, reason: str):
        self.reason = reason

    def client(self, metadata: dict):
        raise UserError(f"this run serves no OpenAI client to its workflow: {self.reason}")


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
