"""Which rollout server answers a turn: servers from the config or from the run's name-resolve (with
heartbeats), probed on ``/health``; a session keeps its server while it is healthy (its prefix cache);
a server that fails mid-turn is marked down and the turn is sent whole to another, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from areal_hpc.launch.name_resolve import ROLLOUT_SERVERS, NameResolve

log = logging.getLogger(__name__)


class NoBackendError(Exception):
    """No healthy rollout server could take the turn."""


class BackendRefusedError(Exception):
    """A rollout server refused the request itself (4xx): another server would refuse it too."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class BackendRouter:
    """Route ``/generate`` calls over the healthy servers; ``refresh`` re-reads the list and probes them."""

    def __init__(self, static: list[str], names: NameResolve | None, token: str | None = None,
                 request_timeout_s: float = 600.0, probe_timeout_s: float = 2.0):
        self.static, self.names = list(static), names
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.request_timeout_s, self.probe_timeout_s = request_timeout_s, probe_timeout_s
        self.healthy: list[str] = []
        self.in_flight: dict[str, int] = {}
        self.retries = 0  # turns sent again after a server failed them
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=self.headers)
        await self.refresh()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def refresh(self) -> None:
        listed = self.static or await asyncio.to_thread(self.names.values, ROLLOUT_SERVERS)
        alive = await asyncio.gather(*(self._probe(address) for address in listed))
        self.healthy = [address for address, ok in zip(listed, alive) if ok]

    async def _probe(self, address: str) -> bool:
        try:
            async with self._http.get(f"http://{address}/health",
                                      timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)) as reply:
                return reply.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def pick(self, affinity: str | None, exclude: set[str]) -> str:
        candidates = [a for a in self.healthy if a not in exclude]
        if not candidates:
            raise NoBackendError("no healthy rollout server" + (" left to retry on" if exclude else ""))
        if affinity in candidates:
            return affinity
        return min(candidates, key=lambda a: self.in_flight.get(a, 0))

    async def generate(self, body: dict, affinity: str | None = None) -> tuple[dict, str]:
        """The server's reply to ``/generate`` and the server that gave it."""
        failed: set[str] = set()
        while True:
            if not self.healthy:
                await self.refresh()
            address = self.pick(affinity, failed)
            self.in_flight[address] = self.in_flight.get(address, 0) + 1
            try:
                async with self._http.post(f"http://{address}/generate", json=body,
                                           timeout=aiohttp.ClientTimeout(total=self.request_timeout_s)) as reply:
                    payload = await reply.json(content_type=None)
                    if reply.status < 400:
                        return payload, address
                    message = (payload.get("error") or {}).get("message") if isinstance(payload, dict) else None
                    if reply.status < 500:
                        raise BackendRefusedError(reply.status, message or reply.reason)
                    reason = f"HTTP {reply.status}: {message}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                self.in_flight[address] -= 1
            log.warning("rollout server %s failed a turn (%s); sending it to another", address, reason)
            failed.add(address)
            if address in self.healthy:
                self.healthy.remove(address)
            self.retries += 1
