"""Trainer side of the weight update: new weights reach every rollout server, two ways (``rl.weight_sync``).

- ``disk``: the model is saved in Hugging Face format to ``<run>/weights/v<version>`` (written aside,
  then renamed: a server never reads half a folder) and each server loads it (/update_weights_from_disk).
- ``distributed``: a standalone gloo/NCCL group (trainer rank 0 + every server) and a torch.distributed
  broadcast per tensor, in buckets of ``weight_sync_bucket_mb`` (one /update_weights_from_distributed
  call per bucket, as SGLang expects).

Each ``push`` returns its bytes and seconds, which the driver logs as metrics.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import torch

from areal_hpc.launch.name_resolve import free_port
from areal_hpc.models.hf import DTYPES, save_model
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.parallel.weight_group import UpdateGroup, broadcast_tensor, join_update_group
from areal_hpc.train.engine import TorchTrainEngine

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
GROUP_NAME = "areal_weight_update"


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class DiskWeightSync:
    def __init__(self, folder: Path, keep: int = 2):
        self.folder, self.keep = folder, keep
        self._pushed: list[Path] = []  # only what this run wrote is ever removed, oldest first
        folder.mkdir(parents=True, exist_ok=True)

    async def connect(self, client: RolloutClient) -> None:
        """Nothing to set up: the shared filesystem is the channel."""

    async def push(self, engine: TorchTrainEngine, client: RolloutClient, version: int) -> dict[str, float]:
        started = time.perf_counter()
        path = self.folder / f"v{version:06d}"
        await asyncio.to_thread(save_model, engine.model, engine.tokenizer, path)
        await client.update_weights_from_disk(str(path.resolve()), version)
        self._pushed.append(path)
        while len(self._pushed) > self.keep:
            shutil.rmtree(self._pushed.pop(0), ignore_errors=True)
        return {"sync/bytes": float(state_bytes(engine.state_dict_for_rollout())),
                "sync/seconds": time.perf_counter() - started}


class DistributedWeightSync:
    def __init__(self, backend: str, bucket_bytes: int, host: str = "127.0.0.1"):
        self.backend, self.bucket_bytes, self.host = backend, bucket_bytes, host
        self.group: UpdateGroup | None = None

    async def connect(self, client: RolloutClient) -> None:
        """Trainer rank 0 is rank 0 of the update group; server i joins as rank i + 1."""
        port, servers = free_port(self.host), list(client.alive)
        world = len(servers) + 1
        joining = asyncio.to_thread(join_update_group, self.backend, self.host, port, 0, world, GROUP_NAME)
        invites = [client.post(server, "/init_weights_update_group",
                               {"master_address": self.host, "master_port": port, "rank_offset": i + 1,
                                "world_size": world, "backend": self.backend, "group_name": GROUP_NAME})
                   for i, server in enumerate(servers)]
        self.group, *_ = await asyncio.gather(joining, *invites)

    async def push(self, engine: TorchTrainEngine, client: RolloutClient, version: int) -> dict[str, float]:
        started = time.perf_counter()
        state = engine.state_dict_for_rollout()
        for bucket in self._buckets(state):
            body = {"names": bucket, "dtypes": [DTYPE_NAMES[state[n].dtype] for n in bucket],
                    "shapes": [list(state[n].shape) for n in bucket], "weight_version": version}
            sending = asyncio.to_thread(lambda names=bucket: [broadcast_tensor(self.group, state[n].contiguous())
                                                              for n in names])
            await asyncio.gather(client.broadcast("/update_weights_from_distributed", body), sending)
        return {"sync/bytes": float(state_bytes(state)), "sync/seconds": time.perf_counter() - started}

    def _buckets(self, state: dict[str, torch.Tensor]) -> list[list[str]]:
        buckets, size = [[]], 0
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(name)
            size += nbytes
        return buckets
