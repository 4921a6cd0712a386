"""Client of a group of rollout servers (embedded or SGLang: one HTTP contract).

``generate`` is AReaL's interruptible generation: when a weight update pauses the servers, the
request comes back with finish reason ``abort`` and its partial output; it is re-submitted with
that output appended to the prompt and ``max_new_tokens`` lowered, to the same server (request-id
affinity), so tokens made before the update keep their old version tag. A new request whose prompt
continues a sequence a server ran (at least half of the prompt: a conversation's earlier turns, a group's
prompt) goes to that server, whose prefix cache holds it (session affinity, by token ids, for callers that
name no server), unless it has ``AFFINITY_SLACK`` more requests outstanding than the least loaded; others
go to the server with the fewest outstanding requests. ``generate_batch`` sends
several (a GRPO group's samples) as one request in SGLang's batch form and resumes each from its own
output. When a request fails (its connection, or a 5xx), the server's ``/health`` decides: a server that
is not healthy is dropped and its requests resume on the others from their last returned output (nothing
is lost); a live one is asked again, a few times.

Servers can join while the client runs (``add_server``: one that registered late, or restarted): the
caller first gives it the current weights, then admits it with their version.

Generation and control traffic use separate connection pools: ``/generate`` gets one connection
per request the run can have in flight (``max_requests``), and pause, continue, weight updates and
health probes never queue behind generation, however many requests are running.

Version tags: a server that reports no per-token versions (SGLang) has its tokens tagged with its
``weight_version`` when that is an integer, else (SGLang's ``"default"``: the weights it was launched
with, or an SGLang that ignores the version an update names) with the version this client last
pushed to it and resumed it on (0 before any push). Every reply comes from one version: an update
pauses (aborts) generation first, and a reply arriving while paused was cut short by that pause.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import aiohttp

from areal_hpc.errors import UserError
from areal_hpc.rollout.prefix_cache import PrefixTree

HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=10)
RETRY_DELAY_S = 0.5
CONNECTION_RETRIES = 3  # failed attempts in a row on a server that still answers /health, then the request fails
ROUTED_TOKENS = 1 << 20  # tokens of recent sequences remembered with the server that ran them
# requests a server may have in flight beyond the least loaded one and still get the sequences it holds
# (sglang-router's balance_abs_threshold): past that, balance wins over the cache
AFFINITY_SLACK = 32


class RolloutError(RuntimeError):
    """Rollouts cannot go on (the run stops with this one-line message)."""


class NoServerError(RolloutError):
    """Every rollout server of the group is gone."""


class ServerReplyError(UserError):
    """A rollout server answered with an HTTP error; the message is the server's own."""

    def __init__(self, server: str, route: str, status: int, message: str):
        super().__init__(f"{server}{route} answered {status}: {message}")
        self.server, self.status = server, status


class ConnectionFailedError(RuntimeError):
    """A request kept failing to connect (or timing out) on a server that still answers /health."""


@dataclass
class Generation:
    """What one (possibly interrupted and resumed) request produced."""

    input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    interruptions: int = 0  # times a pause (weight update) or a dead server cut it short
    server: str = ""
    cached_tokens: int = 0  # prompt tokens the server had in its prefix cache (its first reply's count)


def token_version(reported, known: int) -> int:
    """The version of a reply's tokens: the server's ``weight_version`` if it is an integer (SGLang
    sends it as a string), else the version this client knows the server generates with."""
    try:
        return int(reported)
    except (TypeError, ValueError):
        return known


def _batch_body(bodies: list[dict]) -> dict:
    """One /generate body: a single request as it is, several in SGLang's batch form (a list per field)."""
    if len(bodies) == 1:
        return bodies[0]
    return {
        "input_ids": [b["input_ids"] for b in bodies],
        "rid": [b["rid"] for b in bodies],
        "return_logprob": True,
        "sampling_params": [b["sampling_params"] for b in bodies],
    }


def disk_update(model_path: str, version: int) -> dict:
    """The body of /update_weights_from_disk (SGLang takes the version as a string)."""
    return {"model_path": model_path, "weight_version": str(version)}


class RolloutClient:
    def __init__(
        self, addresses: list[str], request_timeout_s: float = 600.0, max_requests: int = 100, token: str | None = None
    ):
        """``max_requests``: /generate requests the caller may have in flight at once (their pool's size);
        ``token``: the run's rollout token, sent on every request (servers beyond loopback require it)."""
        self.alive = list(addresses)  # the servers /generate goes to
        self.outstanding = dict.fromkeys(addresses, 0)  # /generate requests in flight per server
        self.versions = dict.fromkeys(addresses, 0)  # weight version each server generates with
        self._loaded: dict[str, int] = {}  # versions pushed while paused: in effect from the resume on
        self._paused = False
        self._affinity: dict[str, str] = {}
        self._ran: PrefixTree[str] = PrefixTree(ROUTED_TOKENS, lambda server, _: (server, server))  # where, by ids
        self._probes: dict[str, asyncio.Task] = {}  # one /health probe per server at a time
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._max_requests = max_requests
        self._dropped_because = ""
        self._generation: aiohttp.ClientSession | None = None
        self._control: aiohttp.ClientSession | None = None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def __aenter__(self) -> RolloutClient:
        self._generation = aiohttp.ClientSession(
            timeout=self._timeout, connector=aiohttp.TCPConnector(limit=self._max_requests), headers=self._headers
        )
        self._control = aiohttp.ClientSession(  # per host: servers that join later get the same
            timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0, limit_per_host=16), headers=self._headers
        )
        return self

    async def __aexit__(self, *exc) -> None:
        for probe in self._probes.values():
            probe.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
        await self._generation.close()
        await self._control.close()

    async def generate(
        self, input_ids: list[int], sampling: dict, rid: str | None = None, prefer: str | None = None
    ) -> Generation:
        """Generate to a stop token or ``max_new_tokens``, across pauses and server failures; on
        ``prefer`` while it is alive (a conversation's server, which holds its prefix in cache)."""
        [generation] = await self.generate_batch([input_ids], [sampling], [rid or uuid.uuid4().hex], prefer)
        return generation

    async def generate_batch(
        self, prompts: list[list[int]], samplings: list[dict], rids: list[str] | None = None, prefer: str | None = None
    ) -> list[Generation]:
        """Several generations as one /generate (SGLang's batch form: lists of ``input_ids``,
        ``sampling_params`` and ``rid``) on one server, each resumed after a pause from its own output
        (those that finished are not sent again). They succeed or fail together, as a GRPO group does:
        one HTTP request and reply instead of one per sample."""
        rids = rids or [uuid.uuid4().hex for _ in prompts]
        key = rids[0]  # the batch's server affinity
        if prefer in self.alive:
            self._affinity[key] = prefer
        outs = [Generation(list(ids)) for ids in prompts]
        pending = list(range(len(prompts)))  # those not finished yet
        budgets = [sampling.get("max_new_tokens", 128) for sampling in samplings]
        failed_attempts = 0
        try:
            while pending:
                server = self._pick(key, prompts[0])
                bodies = [
                    {
                        "input_ids": outs[i].input_ids + outs[i].output_ids,
                        "rid": rids[i],
                        "return_logprob": True,
                        "sampling_params": {**samplings[i], "max_new_tokens": budgets[i] - len(outs[i].output_ids)},
                    }
                    for i in pending
                ]
                try:
                    replies = await self.post(server, "/generate", _batch_body(bodies))
                except ServerReplyError as exc:
                    if exc.status < 500 or await self.healthy(server):
                        raise  # a wrong request (e.g. longer than the context), or one the server failed: no retry
                    self.drop(server, str(exc))
                    for i in pending:
                        outs[i].interruptions += 1
                    continue
                except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                    reason = f"{server}/generate: {str(exc) or type(exc).__name__}"
                    if not await self.healthy(server):
                        self.drop(server, reason)
                    elif (failed_attempts := failed_attempts + 1) < CONNECTION_RETRIES:
                        await asyncio.sleep(RETRY_DELAY_S)  # a dropped connection, not a dead server
                    else:
                        raise ConnectionFailedError(
                            f"{reason} ({failed_attempts} times in a row, though the server answers /health)"
                        ) from exc
                    for i in pending:
                        outs[i].interruptions += 1
                    continue
                failed_attempts = 0
                replies = replies if len(bodies) > 1 else [replies]
                for i, reply in zip(pending, replies):
                    self._take_reply(outs[i], reply, server)
                    if len(self.alive) > 1:  # where its sequence is cached, for the turns that continue it
                        self._ran.insert(outs[i].input_ids + outs[i].output_ids, lambda *_: server)  # noqa: B023 - called here
                self._ran.evict()
                pending = [
                    i for i in pending if outs[i].finish_reason == "abort" and len(outs[i].output_ids) < budgets[i]
                ]
                for i in pending:
                    outs[i].interruptions += 1
            return outs
        finally:
            self._affinity.pop(key, None)

    def _take_reply(self, out: Generation, reply: dict, server: str) -> None:
        """Append one /generate answer (part of a generation, or all of it) to ``out``."""
        meta = reply["meta_info"]
        if not out.finish_reason:  # the first reply: its cached tokens are of the prompt as given
            out.cached_tokens = meta.get("cached_tokens") or 0
        out.output_ids += reply["output_ids"]
        out.logprobs += [entry[0] for entry in meta["output_token_logprobs"]]
        out.versions += meta.get("output_token_versions") or [
            token_version(meta.get("weight_version"), self.versions[server])
        ] * len(reply["output_ids"])
        out.finish_reason, out.server = meta["finish_reason"]["type"], server

    async def broadcast(self, route: str, body: dict | None = None, servers: list[str] | None = None) -> list[dict]:
        """POST to every live server at once (pause, continue, weight updates), or to ``servers``; those
        that cannot be reached are dropped, and their replies left out. A body with ``weight_version``
        records that version as the one each server now holds."""
        everyone = servers is None
        body, servers = body or {}, list(self.alive if everyone else servers)
        replies = await asyncio.gather(*(self.post(s, route, body) for s in servers), return_exceptions=True)
        for server, reply in zip(servers, replies):
            if isinstance(reply, (aiohttp.ClientConnectionError, asyncio.TimeoutError)):
                self.drop(server, f"{server}{route}: {reply or type(reply).__name__}")
            elif isinstance(reply, BaseException):
                raise reply
            elif "weight_version" in body:
                (self._loaded if self._paused else self.versions)[server] = int(body["weight_version"])
        if everyone and not self.alive:
            raise self._no_server()
        return [r for r in replies if not isinstance(r, BaseException)]

    def add_server(self, server: str, version: int) -> None:
        """Send /generate to ``server`` from now on; it holds the weights of ``version`` already."""
        self.outstanding.setdefault(server, 0)
        self.versions[server] = version
        self._loaded.pop(server, None)
        if server not in self.alive:
            self.alive.append(server)

    def drop(self, server: str, reason: str) -> None:
        """Send ``server`` no more requests (its running ones resume on the others)."""
        if server in self.alive:
            self.alive.remove(server)
            self._dropped_because = reason

    async def pause(self) -> None:
        self._paused = True
        await self.broadcast("/pause_generation", {"mode": "abort"})

    async def resume(self) -> None:
        self.versions |= self._loaded  # from now on the servers generate with what was pushed meanwhile
        self._loaded, self._paused = {}, False
        await self.broadcast("/continue_generation")

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        await self.broadcast("/update_weights_from_disk", disk_update(model_path, version))

    async def server_info(self, server: str) -> dict:
        """``/get_server_info``: the server's launch arguments (SGLang's; ``tp_size`` among them)."""
        return await self._get(server, "/get_server_info")

    async def model_info(self, server: str) -> dict:
        """``/get_model_info``: the served model (and, on the embedded engine, its ``weight_version``)."""
        return await self._get(server, "/get_model_info")

    async def _get(self, server: str, route: str) -> dict:
        async with self._control.get(f"http://{server}{route}", timeout=HEALTH_TIMEOUT) as response:
            response.raise_for_status()
            return await response.json(content_type=None)

    async def healthy(self, server: str) -> bool:
        """Whether ``server`` answers /health with 200; concurrent askers share one probe."""
        probe = self._probes.get(server)
        if probe is None or probe.done():
            probe = self._probes[server] = asyncio.create_task(self._probe(server))
        return await asyncio.shield(probe)

    async def _probe(self, server: str) -> bool:
        try:
            async with self._control.get(f"http://{server}/health", timeout=HEALTH_TIMEOUT) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    def _pick(self, rid: str, prompt: list[int]) -> str:
        server = self._affinity.get(rid)
        if server not in self.alive:
            if not self.alive:
                raise self._no_server()
            least = min(self.alive, key=lambda s: self.outstanding[s])
            holder = self._holder(prompt)
            server = (
                holder if holder and self.outstanding[holder] <= self.outstanding[least] + AFFINITY_SLACK else least
            )
            self._affinity[rid] = server
        return server

    def _holder(self, prompt: list[int]) -> str | None:
        """The live server that ran the longest sequence ``prompt`` continues, if it covers half the prompt."""
        if len(self.alive) < 2:
            return None
        matched, node = self._ran.match(prompt)
        return node.payload if 2 * matched >= len(prompt) and node.payload in self.alive else None

    def _no_server(self) -> NoServerError:
        if not self._dropped_because:
            return NoServerError("no rollout server has joined yet")
        return NoServerError(f"every rollout server is unhealthy or unreachable (last: {self._dropped_because})")

    async def post(self, server: str, route: str, body: dict) -> dict:
        """POST ``body`` to ``server``: /generate on the generation pool, anything else on the control pool."""
        generation = route == "/generate"
        requests = len(body["rid"]) if generation and isinstance(body.get("rid"), list) else 1
        if generation:
            self.outstanding[server] += requests  # a batch counts each of its requests
        try:
            session = self._generation if generation else self._control
            async with session.post(f"http://{server}{route}", json=body) as response:
                try:
                    reply = await response.json(content_type=None)
                except ValueError:  # not JSON (a proxy's error page, say): keep its first line
                    reply = {"error": {"message": next(iter((await response.text()).splitlines()), "")}}
                if response.status >= 400:
                    error = reply.get("error", reply) if isinstance(reply, dict) else reply
                    message = error.get("message", error) if isinstance(error, dict) else error
                    raise ServerReplyError(server, route, response.status, str(message))
                return reply
        finally:
            if generation:
                self.outstanding[server] -= requests
