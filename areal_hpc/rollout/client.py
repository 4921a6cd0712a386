"""Client of a group of rollout servers (embedded or SGLang: one HTTP contract).

``generate`` is AReaL's interruptible generation: when a weight update pauses the servers, the
request comes back with finish reason ``abort`` and its partial output; it is re-submitted with
that output appended to the prompt and ``max_new_tokens`` lowered, to the same server (request-id
affinity), so tokens made before the update keep their old version tag. New requests go to the
server with the fewest outstanding requests. When a request's connection fails, the server's
``/health`` decides: a server that no longer answers is dropped and its requests resume on the
others from their last returned output (nothing is lost); a live one is simply asked again.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import aiohttp

from areal_hpc.errors import UserError


HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=10)
RETRY_DELAY_S = 0.5


class NoServerError(RuntimeError):
    """Every rollout server of the group is gone."""


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


class RolloutClient:
    def __init__(self, addresses: list[str], request_timeout_s: float = 600.0):
        if not addresses:
            raise UserError("no rollout server addresses given")
        self.alive = list(addresses)
        self.outstanding = dict.fromkeys(addresses, 0)
        self._affinity: dict[str, str] = {}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "RolloutClient":
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def generate(self, input_ids: list[int], sampling: dict, rid: str | None = None) -> Generation:
        """Generate to a stop token or ``max_new_tokens``, across pauses and server failures."""
        rid = rid or uuid.uuid4().hex
        out = Generation(list(input_ids))
        budget = sampling.get("max_new_tokens", 128)
        try:
            while True:
                server = self._pick(rid)
                body = {"input_ids": out.input_ids + out.output_ids, "rid": rid, "return_logprob": True,
                        "sampling_params": {**sampling, "max_new_tokens": budget - len(out.output_ids)}}
                try:
                    reply = await self.post(server, "/generate", body)
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
                    if await self._healthy(server):  # a dropped connection, not a dead server
                        await asyncio.sleep(RETRY_DELAY_S)
                    else:
                        self._drop(server)
                    out.interruptions += 1
                    continue
                meta = reply["meta_info"]
                out.output_ids += reply["output_ids"]
                out.logprobs += [entry[0] for entry in meta["output_token_logprobs"]]
                out.versions += meta.get("output_token_versions") or [int(meta["weight_version"])] * len(reply["output_ids"])
                out.finish_reason, out.server = meta["finish_reason"]["type"], server
                if out.finish_reason != "abort" or len(out.output_ids) >= budget:
                    return out
                out.interruptions += 1
        finally:
            self._affinity.pop(rid, None)

    async def broadcast(self, route: str, body: dict | None = None) -> list[dict]:
        """POST to every live server at once (pause, continue, weight updates); dead ones are dropped."""
        servers = list(self.alive)
        replies = await asyncio.gather(*(self.post(s, route, body or {}) for s in servers), return_exceptions=True)
        for server, reply in zip(servers, replies):
            if isinstance(reply, (aiohttp.ClientConnectionError, asyncio.TimeoutError)):
                self._drop(server)
            elif isinstance(reply, BaseException):
                raise reply
        if not self.alive:
            raise NoServerError("every rollout server stopped answering")
        return [r for r in replies if not isinstance(r, BaseException)]

    async def pause(self) -> None:
        await self.broadcast("/pause_generation", {"mode": "abort"})

    async def resume(self) -> None:
        await self.broadcast("/continue_generation")

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        await self.broadcast("/update_weights_from_disk", {"model_path": model_path, "weight_version": version})

    def _pick(self, rid: str) -> str:
        server = self._affinity.get(rid)
        if server not in self.alive:
            if not self.alive:
                raise NoServerError("every rollout server stopped answering")
            server = min(self.alive, key=lambda s: self.outstanding[s])
            self._affinity[rid] = server
        return server

    async def _healthy(self, server: str) -> bool:
        try:
            async with self._session.get(f"http://{server}/health", timeout=HEALTH_TIMEOUT) as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    def _drop(self, server: str) -> None:
        if server in self.alive:
            self.alive.remove(server)

    async def post(self, server: str, route: str, body: dict) -> dict:
        self.outstanding[server] += 1
        try:
            async with self._session.post(f"http://{server}{route}", json=body) as response:
                reply = await response.json(content_type=None)
                if response.status >= 400:
                    raise UserError(f"{server}{route} answered {response.status}: "
                                    f"{reply.get('error', {}).get('message', reply)}")
                return reply
        finally:
            self.outstanding[server] -= 1
