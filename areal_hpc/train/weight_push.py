"""Trainer side of the weight update: new weights reach every rollout server, two ways (``rl.weight_sync``).

- ``disk``: the engine saves the model in Hugging Face format to ``<run>/weights/v<version>`` (written
  aside, then renamed: a server never reads half a folder) and each server loads it
  (/update_weights_from_disk).
- ``distributed``: a standalone gloo/NCCL group (trainer rank 0 + every server) and a torch.distributed
  broadcast per tensor of the engine's ``rollout_weights`` buckets (``weight_sync_bucket_mb``; one
  /update_weights_from_distributed call per bucket, as SGLang expects). Connecting again (e.g. after a
  server restart) first destroys the previous group, so two groups never hold the trainer's port,
  sockets or (NCCL) communicator memory at once.

Both use only the ``TrainEngine`` protocol. Each ``push`` returns its bytes and seconds, which the
driver logs as metrics.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

from areal_hpc.launch.name_resolve import free_port
from areal_hpc.models.hf import DTYPES
from areal_hpc.parallel.weight_group import UpdateGroup, broadcast_tensor, join_update_group
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.train.engine import TrainEngine, WeightBucket

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
GROUP_NAME = "areal_weight_update"


def bucket_bytes(bucket: WeightBucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


class DiskWeightSync:
    def __init__(self, folder: Path, keep: int = 2):
        self.folder, self.keep = folder, keep
        self._pushed: list[Path] = []  # only what this run wrote is ever removed, oldest first
        folder.mkdir(parents=True, exist_ok=True)

    async def connect(self, client: RolloutClient) -> None:
        """Nothing to set up: the shared filesystem is the channel."""

    async def push(self, engine: TrainEngine, client: RolloutClient, version: int) -> dict[str, float]:
        """``sync/bytes``: the weight files the servers read."""
        started = time.perf_counter()
        path = self.folder / f"v{version:06d}"
        await asyncio.to_thread(engine.save, path, optimizer=False)
        await client.update_weights_from_disk(str(path.resolve()), version)
        written = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        self._pushed.append(path)
        while len(self._pushed) > self.keep:
            shutil.rmtree(self._pushed.pop(0), ignore_errors=True)
        return {"sync/bytes": float(written), "sync/seconds": time.perf_counter() - started}


class DistributedWeightSync:
    def __init__(self, backend: str, bucket_bytes: int, host: str = "127.0.0.1"):
        self.backend, self.bucket_bytes, self.host = backend, bucket_bytes, host
        self.group: UpdateGroup | None = None

    async def connect(self, client: RolloutClient) -> None:
        """Trainer rank 0 is rank 0 of the update group; server i joins as rank i + 1. A group of an
        earlier ``connect`` is destroyed first."""
        self.destroy_group()
        port, servers = free_port(self.host), list(client.alive)
        world = len(servers) + 1
        joining = asyncio.to_thread(join_update_group, self.backend, self.host, port, 0, world, GROUP_NAME)
        invites = [client.post(server, "/init_weights_update_group",
                               {"master_address": self.host, "master_port": port, "rank_offset": i + 1,
                                "world_size": world, "backend": self.backend, "group_name": GROUP_NAME})
                   for i, server in enumerate(servers)]
        self.group, *_ = await asyncio.gather(joining, *invites)

    def destroy_group(self) -> None:
        """Close the update group and drop it, which releases its store (its port) and sockets now."""
        if self.group is not None:
            self.group.close()
            self.group = None

    async def push(self, engine: TrainEngine, client: RolloutClient, version: int) -> dict[str, float]:
        started, sent = time.perf_counter(), 0
        for bucket in engine.rollout_weights(self.bucket_bytes):
            body = {"names": [name for name, _ in bucket], "dtypes": [DTYPE_NAMES[t.dtype] for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "weight_version": version}
            sending = asyncio.to_thread(lambda tensors=[t for _, t in bucket]:
                                        [broadcast_tensor(self.group, t) for t in tensors])
            await asyncio.gather(client.broadcast("/update_weights_from_distributed", body), sending)
            sent += bucket_bytes(bucket)
        return {"sync/bytes": float(sent), "sync/seconds": time.perf_counter() - started}
