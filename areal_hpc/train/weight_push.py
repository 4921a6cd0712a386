"""Trainer side of the weight update: new weights reach every rollout server, two ways (``rl.weight_sync``),
and servers that join while the run goes on (registered late, or restarted) get them before any request.

- ``disk``: the engine saves the model in Hugging Face format to ``<run>/weights/v<version>`` on the shared
  filesystem (written aside, then renamed: a server never reads half a folder), and each server, on
  whichever node, loads it (/update_weights_from_disk). A server that joins loads the latest folder first.
- ``distributed``: a standalone gloo/NCCL group, trainer rank 0 plus one rank per TP rank of every
  server, and a broadcast per tensor of the engine's ``rollout_weights`` buckets (``weight_sync_bucket_mb``;
  one /update_weights_from_distributed call per bucket, as SGLang expects). Rank 0 hosts the group's
  store at ``host`` (its address as the servers' nodes reach it) on a port the system picks. Before each
  push every server is asked /health: when one is gone, or one joined, the group is re-formed with the
  live ones (the old group destroyed first, on both sides, so two never hold sockets or NCCL memory at
  once); a server that dies during a push fails it, and the push is repeated through a re-formed group.
  A server that joins gets the weights, and then requests, with the next push.

SGLang's HTTP side of the distributed update (``python/sglang/srt/managers/io_struct.py``,
``python/sglang/srt/entrypoints/http_server.py``): /init_weights_update_group takes ``master_address,
master_port, rank_offset, world_size, group_name, backend`` and answers once the server's ranks
(``rank_offset + tp_rank``; ``tp_size`` from /get_server_info) joined; /update_weights_from_distributed takes
``names, dtypes, shapes, group_name, weight_version`` (a string) and answers once it received the tensors
of rank 0's broadcasts, in order; /destroy_weights_update_group takes ``group_name``. Each answers
``{"success", "message"}``, 200 or 400. The group itself is set up in ``parallel/weight_group.py``. An
SGLang server joins only with dp_size 1 (or DP attention), as its tokenizer manager requires.

Both use only the ``TrainEngine`` protocol. ``stage`` does what needs no paused server (the disk sync
writes the folder while generation goes on), ``push`` what does (the servers load); each returns its
bytes and seconds, which the driver logs as metrics. ``stages_a_copy``: whether ``push`` reads only what
``stage`` wrote, so the next update may run while it goes on (the disk sync), or the engine's own
tensors, collectively over the trainer's ranks (the broadcast: the driver waits for it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import shutil
import time
import uuid
from pathlib import Path

import aiohttp

from areal_hpc.engines.base import TrainEngine, WeightBucket
from areal_hpc.models.hf import DTYPES
from areal_hpc.parallel.weight_group import (
    GROUP_TIMEOUT_S,
    WeightChannel,
    broadcast_tensor,
    host_store,
    join_update_group,
)
from areal_hpc.rollout.client import NoServerError, RolloutClient, RolloutError, ServerReplyError, disk_update
from areal_hpc.runtime.name_resolve import ServerDirectory

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
GROUP_NAME = "areal_weight_update"  # each group formed gets a suffix of its own (see _form)
PUSH_ATTEMPTS = 3  # group formations a push (or connect) tries while servers keep failing it
ABANDON_AFTER_S = 30.0  # after a failure, how long the rest of a transfer may take to fail too before we move on
DISCOVERY_POLL_S = 2.0  # a server that registers is noticed within this; each poll lists one small folder


def bucket_bytes(bucket: WeightBucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


class DiskWeightSync:
    stages_a_copy = True

    def __init__(self, folder: Path, keep: int = 2, executor: concurrent.futures.Executor | None = None):
        """``executor``: the thread that writes each folder (None: asyncio's default threads); the driver
        gives it the update's own thread, whose core is free then while the servers' cores generate."""
        self.folder, self.keep, self.executor = folder, keep, executor
        self._pushed: list[Path] = []  # only what this run wrote is ever removed, oldest first
        self._latest: tuple[Path, int] | None = None
        self._staged: int | None = None  # the version whose folder this run wrote last
        self._lock = asyncio.Lock()  # a server admitted during a push would miss it
        folder.mkdir(parents=True, exist_ok=True)

    async def connect(self, client: RolloutClient) -> None:
        """Nothing to set up: the shared filesystem is the channel."""

    async def stage(self, engine: TrainEngine, version: int) -> dict[str, float]:
        """Write version ``version``'s folder (before generation pauses for the load)."""
        started = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(engine.save, self._path(version), optimizer=False)
        )
        self._staged = version
        return {"sync/stage_seconds": time.perf_counter() - started}

    def _path(self, version: int) -> Path:
        return self.folder / f"v{version:06d}"

    async def push(self, engine: TrainEngine, client: RolloutClient, version: int) -> dict[str, float]:
        """``sync/bytes``: the weight files the servers read (written now unless ``stage`` did)."""
        async with self._lock:
            path = self._path(version)
            if self._staged != version:  # a folder of that name from an earlier incarnation is not this one's
                await self.stage(engine, version)
            started = time.perf_counter()
            await client.update_weights_from_disk(str(path.absolute()), version)
            self._latest = path, version
            written = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            self._pushed.append(path)
            while len(self._pushed) > self.keep:
                shutil.rmtree(self._pushed.pop(0), ignore_errors=True)
            return {"sync/bytes": float(written), "sync/seconds": time.perf_counter() - started}

    async def admit(self, client: RolloutClient, server: str) -> str:
        """``server`` loads the weights pushed last, then gets requests."""
        async with self._lock:
            if self._latest is None:  # nothing pushed yet: the first push reaches it
                client.add_server(server, 0)
                return "joined"
            path, version = self._latest
            await client.post(server, "/update_weights_from_disk", disk_update(str(path.absolute()), version))
            client.add_server(server, version)
            return f"joined with the weights of version {version}"


class WeightChannelBroken(RuntimeError):
    """The update group failed (a member died, or could not join): it is re-formed. ``server``: the
    one that failed while it answered /health, if known; it is used no more (a restart joins again)."""

    def __init__(self, message: str, server: str = ""):
        super().__init__(message)
        self.server = server


class DistributedWeightSync:
    stages_a_copy = False

    def __init__(self, backend: str, bucket_bytes: int, host: str = "127.0.0.1"):
        """``host``: trainer rank 0's address as the servers' nodes reach it (loopback: all on one machine)."""
        self.backend, self.bucket_bytes, self.host = backend, bucket_bytes, host
        self.group: WeightChannel | None = None
        self.members: list[str] = []  # the servers in the group, in rank order
        self._name = ""
        self._joining: list[str] = []  # admitted, waiting for the next push
        self._lock = asyncio.Lock()

    async def connect(self, client: RolloutClient) -> None:
        """Form the group with every live server (an earlier group is destroyed first)."""
        async with self._lock:
            self.destroy_group()
            await self._in_group(client)

    async def admit(self, client: RolloutClient, server: str) -> str:
        """``server`` gets the weights, then requests, with the next push (through a re-formed group)."""
        async with self._lock:
            if server not in self._joining:
                self._joining.append(server)
            return "joins with the next weight push"

    async def stage(self, engine: TrainEngine, version: int) -> dict[str, float]:
        """Nothing to stage: the broadcast reads the engine's tensors while the servers are paused."""
        return {}

    async def push(self, engine: TrainEngine, client: RolloutClient, version: int) -> dict[str, float]:
        async with self._lock:
            started = time.perf_counter()
            sent = await self._in_group(client, lambda: self._send(engine, client, version))
            for server in self._joining:
                client.add_server(server, version)
            self._joining = []
            return {"sync/bytes": float(sent), "sync/seconds": time.perf_counter() - started}

    def destroy_group(self) -> None:
        """Close the update group and drop it, which releases its store (its port) and sockets now."""
        if self.group is not None:
            self.group.close()
            self.group = None

    async def _in_group(self, client: RolloutClient, work=None):
        """``work()`` (if any) once the group holds exactly the live servers (re-formed if one died or
        joined); a member failing meanwhile re-forms it and starts ``work`` again, a few times at most."""
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            try:
                live = await self._live(client)
                if self.group is None or live != self.members or self._joining:
                    await self._form(client, live)
                return await work() if work else None
            except WeightChannelBroken as exc:
                self.destroy_group()
                if exc.server:
                    client.drop(exc.server, str(exc))
                    self._joining = [s for s in self._joining if s != exc.server]
                if attempt == PUSH_ATTEMPTS:
                    raise RolloutError(f"the weight update group failed {attempt} times, the last: {exc}") from None

    async def _live(self, client: RolloutClient) -> list[str]:
        """The servers (live ones and joining ones) that answer /health now; the others are dropped."""
        servers = list(dict.fromkeys(client.alive + self._joining))
        healthy = dict(zip(servers, await asyncio.gather(*(client.healthy(s) for s in servers))))
        for server in servers:
            if not healthy[server]:
                client.drop(server, f"{server}/health: no answer before a weight push")
        self._joining = [s for s in self._joining if healthy[s]]
        if not any(healthy.values()):
            raise NoServerError(f"no rollout server answers /health (asked {', '.join(servers) or 'none'})")
        return [s for s in servers if healthy[s]]

    async def _form(self, client: RolloutClient, servers: list[str]) -> None:
        """A new group of rank 0 and every TP rank of ``servers``; the old one is destroyed on both sides."""
        self.destroy_group()  # first here: a server still blocked on the old group fails at once
        if self.members:  # SGLang keeps a group until told to destroy it (NCCL memory): a dead one cannot be
            await asyncio.gather(
                *(
                    client.post(s, "/destroy_weights_update_group", {"group_name": self._name})
                    for s in self.members
                    if s in servers
                ),
                return_exceptions=True,
            )
        self.members = []
        infos = await asyncio.gather(*(client.server_info(s) for s in servers), return_exceptions=True)
        for server, info in zip(servers, infos):
            if isinstance(info, (aiohttp.ClientError, asyncio.TimeoutError)):
                raise WeightChannelBroken(f"{server}/get_server_info: {str(info) or type(info).__name__}", server)
        tp_sizes = [int(info.get("tp_size", 1)) for info in infos]
        world = 1 + sum(tp_sizes)
        # A name of its own per group: SGLang refuses to join a name it still holds (one a trainer that
        # died never destroyed).
        name = f"{GROUP_NAME}-{uuid.uuid4().hex[:8]}"
        store = await asyncio.to_thread(host_store, self.host, world)
        joining = asyncio.ensure_future(
            asyncio.to_thread(
                join_update_group, self.backend, self.host, store.port, 0, world, name, GROUP_TIMEOUT_S, store
            )
        )
        offsets = itertools.accumulate([1] + tp_sizes[:-1])
        invites = await asyncio.gather(
            *(
                client.post(
                    s,
                    "/init_weights_update_group",
                    {
                        "master_address": self.host,
                        "master_port": store.port,
                        "rank_offset": offset,
                        "world_size": world,
                        "backend": self.backend,
                        "group_name": name,
                    },
                )
                for s, offset in zip(servers, offsets)
            ),
            return_exceptions=True,
        )
        failed = [(s, r) for s, r in zip(servers, invites) if isinstance(r, BaseException)]
        if failed:  # rank 0 waits for ranks that will not come: left to time out in its thread
            joining.add_done_callback(consume)
            server, error = failed[0]
            raise WeightChannelBroken(
                f"{server} did not join the update group: {str(error) or type(error).__name__}", server
            )
        self.group, self.members, self._name = await joining, servers, name

    async def _send(self, engine: TrainEngine, client: RolloutClient, version: int) -> int:
        """Every bucket to every member; the bytes sent. A member failing mid-transfer: WeightChannelBroken."""
        sent = 0
        for bucket in engine.rollout_weights(self.bucket_bytes):
            body = {
                "names": [name for name, _ in bucket],
                "dtypes": [DTYPE_NAMES[t.dtype] for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self._name,
                "weight_version": str(version),
            }
            sending = asyncio.ensure_future(asyncio.to_thread(broadcast_all, self.group, [t for _, t in bucket]))  # noqa: RUF006 - held and awaited below
            answers = asyncio.ensure_future(client.broadcast("/update_weights_from_distributed", body, self.members))
            for task in (sending, answers):
                task.add_done_callback(consume)
            pending, failure = {sending, answers}, None
            while pending and failure is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                failure = transfer_failure(done, sending, answers, len(self.members))
            if failure is not None:
                self.destroy_group()  # members still receiving fail now, instead of at the group's timeout
                await asyncio.wait(pending, timeout=ABANDON_AFTER_S)
                if answers.done() and isinstance(error := answers.exception(), ServerReplyError) and not failure.server:
                    failure = WeightChannelBroken(f"{failure}; {error}")  # what the server saw of it
                raise failure
            if answers.exception() is not None:  # a 4xx: a bucket that does not fit the server's model
                raise answers.exception()
            sent += bucket_bytes(bucket)
        return sent


def broadcast_all(group: WeightChannel, tensors: list) -> str:
    """Rank 0's side of one bucket: '' once sent, else why not. The error is returned as text: the
    exception's traceback would keep the group, and so its connections, alive."""
    try:
        for tensor in tensors:
            broadcast_tensor(group, tensor)
    except RuntimeError as exc:
        return f"broadcast: {exc}"
    return ""


def transfer_failure(
    done: set, sending: asyncio.Future, answers: asyncio.Future, members: int
) -> WeightChannelBroken | None:
    """Why a bucket's transfer failed, from the parts of it ``done``; None while none did. A server's
    4xx is none (it received the bucket but its model does not take it: the caller raises it, since
    pushing again would not help), unless rank 0's broadcast failed too."""
    if sending in done and sending.result():
        return WeightChannelBroken(sending.result())
    if answers in done:
        error = answers.exception()
        if isinstance(error, ServerReplyError) and error.status >= 500:
            return WeightChannelBroken(str(error), error.server)
        if error is None and len(answers.result()) < members:
            return WeightChannelBroken("a server could not be reached during the transfer")
        if error is not None and not isinstance(error, ServerReplyError):
            raise error  # every server gone (NoServerError), or a bug
    return None


def consume(task: asyncio.Future) -> None:
    """Retrieve a task's exception (one we report otherwise, or one of a transfer we gave up on)."""
    if not task.cancelled():
        task.exception()


async def admit_servers(directory: ServerDirectory, client: RolloutClient, sync, report=print) -> None:
    """Run for the whole run (cancel it at the end): servers that registered since the last look, late
    or restarted, get the weights the others hold, then requests; ``report`` gets one line each."""
    while True:
        await asyncio.sleep(DISCOVERY_POLL_S)
        for server in await asyncio.to_thread(directory.changes):
            client.drop(server, f"{server} restarted")  # a restarted server holds its launch weights, not ours
            try:
                report(f"rollout server {server} {await sync.admit(client, server)}")
            except (TimeoutError, aiohttp.ClientError, ServerReplyError) as exc:
                report(f"rollout server {server} registered but could not join: {str(exc) or type(exc).__name__}")
