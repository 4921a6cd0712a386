"""Which rollout servers the proxy's turns go to: those of the config, or those the run's name-resolve
lists (with heartbeats), probed on ``/health`` and admitted as they appear. Generation itself is the
trainer's own ``RolloutClient``: interruptible (a weight update's pause resumes the turn with its partial
output), and a server that dies mid-turn has the turn finished by another from its last output, so
nothing is lost; a conversation stays on its server while that one is alive (its prefix cache).
"""

from __future__ import annotations

import asyncio

from areal_hpc.rollout.client import Generation, RolloutClient
from areal_hpc.runtime.name_resolve import ROLLOUT_SERVERS, NameResolve


class BackendRouter:
    def __init__(
        self,
        static: list[str],
        names: NameResolve | None,
        token: str | None = None,
        request_timeout_s: float = 600.0,
        max_requests: int = 1024,
    ):
        self.static, self.names = list(static), names
        self.client = RolloutClient([], request_timeout_s, max_requests, token)  # refresh() admits servers
        self.interrupted = 0  # turns cut short by a pause or a failed server, then finished
        self.version = 0  # the newest weight version a server reported: the trainer's, near enough

    @property
    def healthy(self) -> list[str]:
        return list(self.client.alive)

    async def start(self) -> None:
        await self.client.__aenter__()
        await self.refresh()

    async def close(self) -> None:
        await self.client.__aexit__(None, None, None)

    async def refresh(self) -> None:
        """Admit listed servers that answer /health (new, restarted or back); drop listed ones that do not."""
        listed = self.static or await asyncio.to_thread(self.names.values, ROLLOUT_SERVERS)
        alive = await asyncio.gather(*(self.client.healthy(address) for address in listed))
        for address, ok in zip(listed, alive):
            if ok and address not in self.client.alive:
                self.client.add_server(address, self.client.versions.get(address, 0))
            elif not ok:
                self.client.drop(address, f"{address}/health did not answer")
        infos = await asyncio.gather(*(self.client.model_info(a) for a in self.client.alive), return_exceptions=True)
        for info in infos:
            if isinstance(info, dict):
                self.saw_version(info.get("weight_version"))

    def saw_version(self, reported) -> None:
        try:
            self.version = max(self.version, int(reported))
        except (TypeError, ValueError):  # SGLang's "default": the launch weights, or no versions kept
            pass

    async def generate(self, body: dict, prefer: str | None) -> Generation:
        if not self.client.alive:
            await self.refresh()
        generation = await self.client.generate(body["input_ids"], body["sampling_params"], prefer=prefer)
        self.interrupted += generation.interruptions > 0
        if generation.versions:
            self.saw_version(max(generation.versions))
        return generation
