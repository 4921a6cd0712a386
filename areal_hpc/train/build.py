"""Everything a trainer rank and the asynchronous RL driver are made of, built from the config: the
process group and mesh, the actor (with a frozen reference for the KL penalty and a critic for PPO
when the config asks for them), rollout servers found in name-resolve, the workflow, the shard writer
and consumer, the staleness gate and controller, the weight push, and resume state from the shards.

``driver.py`` holds the loop itself; this module keeps the wiring out of it. Every rank builds the same
engines from ``model.path``; the launcher points it at the SFT warm-up output (or the run's initial
model) and ``--resume`` then loads the checkpoint over it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import torch

from areal_hpc.agents.engine import EpisodeSettings, Sampling, Scorer
from areal_hpc.agents.groups import EpisodeGroups
from areal_hpc.algo.filters import is_informative_group
from areal_hpc.builtins import uses_critic
from areal_hpc.config import RunConfig
from areal_hpc.data.prompts import PromptStream
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.shards.consumer import ConsumerCursor, TrajectoryConsumer
from areal_hpc.data.shards.reader import TrajectoryFilter, TrajectoryStore
from areal_hpc.data.shards.writer import PROXY_WRITER_PREFIX, TrajectoryShardWriter
from areal_hpc.data.trajectory import Trajectory
from areal_hpc.engines.base import TrainEngine
from areal_hpc.engines.factory import build_engine
from areal_hpc.errors import UserError
from areal_hpc.layout import MixedLayout
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.parallel.device import check_precision, resolve_device
from areal_hpc.parallel.mesh import BACKENDS, TrainMesh, build_group_meshes, init_distributed
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.rollout.controller import Episode, FailureBudget, RolloutController
from areal_hpc.rollout.staleness import StalenessGate
from areal_hpc.runtime.bootstrap import node_address
from areal_hpc.runtime.name_resolve import NameResolve, ServerDirectory
from areal_hpc.runtime.run_state import latest_checkpoint
from areal_hpc.train.actor import PPOActor
from areal_hpc.train.checkpoint import load_checkpoint
from areal_hpc.train.weight_push import DiskWeightSync, DistributedWeightSync

SHARD_WRITER = "rollout"


def start_trainer(cfg: RunConfig) -> tuple[int, TrainMesh]:
    """(rank, mesh) of this process: the trainer ranks laid out by ``actor.parallel`` (this rank's
    group's mesh with ``actor.parallel.groups``)."""
    device = resolve_device(cfg.cluster.device)
    rank, world = init_distributed(device)
    layout = MixedLayout.from_config(cfg.actor.parallel, world)
    mesh = build_group_meshes(layout, device)
    if mesh.mixed:
        dims = mesh.dims
        print(
            f"[trainer] rank {rank}: training group {mesh.index} of {len(layout.groups)} (dp{dims.dp} tp{dims.tp} "
            f"pp{dims.pp}), batch share {mesh.data_rank} of {layout.replicas}",
            flush=True,
        )
    return rank, mesh


def build_engines(cfg: RunConfig, mesh, resume: bool) -> tuple[PPOActor, dict[str, TrainEngine], dict]:
    """This rank's actor and engines, from the run's latest checkpoint with ``resume``; and the
    checkpoint's driver state (``{"step": 0}`` for a fresh run)."""
    actor, engines = build_actor(cfg, mesh)
    checkpoint = latest_checkpoint(cfg.run_dir) if resume else None
    state = load_checkpoint(checkpoint, engines) if checkpoint else {"step": 0}
    return actor, engines, state


def build_actor(cfg: RunConfig, mesh: TrainMesh | None) -> tuple[PPOActor, dict[str, TrainEngine]]:
    """The PPO actor and the engines a checkpoint holds (actor, and critic for PPO), on the trainer mesh,
    each built by ``engines.factory.build_engine``. The policy and the reference compute logprobs at the
    sampler's temperature. ``cfg``: a resolved run's config (``resolve(cfg, host).cfg``: its rules hold, its
    auto values decided). ``mesh=None``: one process without a process group, on ``cluster.device``."""
    if not cfg.model.path:
        raise UserError("the trainer needs model.path=DIR (the launcher sets it to the run's starting model)")
    path, model, actor_cfg = cfg.model.path, cfg.model, cfg.actor
    tokenizer = load_tokenizer(cfg.tokenizer.path or path)
    device = mesh.device if mesh is not None else resolve_device(cfg.cluster.device)
    check_precision(device, model_dtype=model.dtype, model_compute_dtype=model.compute_dtype)

    def engine(role: str) -> TrainEngine:
        return build_engine(role, cfg, mesh, path, tokenizer)

    if actor_cfg.lora.rank:
        torch.manual_seed(cfg.experiment.seed)  # the adapters' initialisation depends on the seed only
    engines = {"actor": engine("policy")}
    if uses_critic(actor_cfg.adv_estimator):
        torch.manual_seed(cfg.experiment.seed)  # the value head's initialisation depends on the seed only
        engines["critic"] = engine("critic")
    # The frozen starting weights for the KL penalty; not checkpointed (they never change).
    reference = engine("reference") if actor_cfg.kl_coef > 0 else None
    return PPOActor(
        engines["actor"],
        actor_cfg,
        reference,
        engines.get("critic"),
        mesh.group("dp") if mesh is not None else None,
        cfg.distill.kl_weight,
    ), engines


async def wait_for_servers(cfg: RunConfig, timeout_s: float) -> tuple[list[str], ServerDirectory]:
    """The ``host:port`` of every live rollout server of this run, once all ``rollout.n_servers`` registered
    (entries of an earlier launch, or of a dead server, do not count), and the directory that then tells
    which servers register later: late ones, and restarted ones."""
    directory = ServerDirectory(NameResolve(cfg.run_dir / "name_resolve"))
    deadline = time.monotonic() + timeout_s
    while len(addresses := await asyncio.to_thread(directory.current)) < cfg.rollout.n_servers:
        if time.monotonic() > deadline:
            raise UserError(
                f"{len(addresses)} of {cfg.rollout.n_servers} rollout servers registered in "
                f"{directory.names.root} within {timeout_s:g} s (see {cfg.run_dir / 'logs'})"
            )
        await asyncio.sleep(0.2)
    return addresses, directory


def build_weight_sync(cfg: RunConfig, device_type: str, executor: concurrent.futures.Executor | None = None):
    """``executor``: where the disk sync writes the weights' folders (see ``DiskWeightSync``)."""
    if cfg.rl.weight_sync == "disk":
        return DiskWeightSync(cfg.run_dir / "weights", executor=executor)
    backend = BACKENDS[device_type] if device_type == "cuda" else "gloo"
    # Servers on other nodes connect to trainer rank 0's group store: its routable address, not loopback.
    return DistributedWeightSync(backend, cfg.rl.weight_sync_bucket_mb << 20, host=node_address(cfg.cluster.interface))


def engine_settings(
    cfg: RunConfig, client: RolloutClient, tokenizer, rewards: RewardPool, chat=None
) -> EpisodeSettings:
    """What every episode's engine shares: the rollout client's ``generate`` (and its batch form, for a
    group's samples), the run's sampling and reward."""
    return EpisodeSettings(
        client.generate,
        tokenizer,
        Sampling.from_config(cfg.generation),
        Scorer(rewards),
        chat,
        cfg.rollout.turn_discount,
        generate_batch=client.generate_batch,
    )


def build_controller(
    cfg: RunConfig,
    client,
    workflow: EpisodeGroups,
    prompts: PromptStream,
    writer: TrajectoryShardWriter,
    version: int,
    on_drop,
    commit_executor: concurrent.futures.Executor | None = None,
    stopping: asyncio.Event | None = None,
) -> RolloutController:
    """The run's rollout controller; accepted groups are committed to the shards on ``commit_executor`` (those
    that finished during the previous commit together)."""
    gate = StalenessGate.resumed(
        cfg.rollout.consumer_batch_size,
        cfg.rollout.max_head_offpolicyness,
        cfg.rollout.max_concurrent_rollouts,
        version,
    )

    def store(episodes: list[Episode]) -> None:  # one commit of whole groups: a crash never leaves half a group
        for episode in episodes:
            for trajectory in episode.trajectories:
                writer.append(trajectory)
        writer.flush()

    accept = (
        (lambda group: is_informative_group([t.reward or 0.0 for t in group]))
        if cfg.actor.dynamic_sampling
        else (lambda group: True)
    )
    return RolloutController(
        client,
        workflow,
        gate,
        prompts,
        on_accept=store,
        accept=accept,
        on_drop=on_drop,
        budget=FailureBudget.from_config(cfg.rollout.failure_budget),
        accept_executor=commit_executor,
        stopping=stopping,
    )


def open_shards(cfg: RunConfig, cursor_state: dict) -> tuple[TrajectoryShardWriter, TrajectoryConsumer]:
    folder = cfg.run_dir / "shards"
    writer = TrajectoryShardWriter(
        folder, SHARD_WRITER, experiment=cfg.experiment.name, trial=cfg.experiment.trial, flush_every=1 << 30
    )  # flushed per group
    # Only this run's own rollouts: records other writers store beside them (a proxy's tenants) are
    # never swept into its training or its recovery after a resume.
    return writer, TrajectoryConsumer(
        TrajectoryStore(folder),
        ConsumerCursor.from_state_dict(cursor_state),
        where=TrajectoryFilter(writer=SHARD_WRITER),
    )


def open_proxy_records(cfg: RunConfig, cursor_state: dict | None) -> TrajectoryConsumer | None:
    """The second rollout source: records the login-node proxies wrote into the run's shards, with their
    own cursor (saved in the checkpoint beside the rollouts' own), once they have a reward; None when
    ``rl.proxy_records_per_step`` is 0."""
    if not cfg.rl.proxy_records_per_step:
        return None
    where = TrajectoryFilter(writer=f"{PROXY_WRITER_PREFIX}*", tenant=cfg.rl.proxy_tenant or None, eligible_only=True)
    return TrajectoryConsumer(
        TrajectoryStore(cfg.run_dir / "shards"),
        ConsumerCursor.from_state_dict(cursor_state),
        where=where,
        require_reward=True,
    )


def take_proxy_records(
    consumer: TrajectoryConsumer, n: int, version: int, eta: int
) -> tuple[list[Trajectory], list[Trajectory]]:
    """Up to ``n`` rewarded proxy records, oldest first, as (trainable, too stale): a record whose oldest
    output token is more than ``eta`` versions behind ``version`` is consumed without training, as a
    rollout that stale would be."""
    records = consumer.poll(n)
    fresh = [t for t in records if t.version_range[0] >= version - eta]
    return fresh, [t for t in records if t.version_range[0] < version - eta]


def recovered_episodes(consumer: TrajectoryConsumer, version: int) -> list[Episode]:
    """Groups that were stored before a restart but not trained by the checkpoint we resumed from.
    Those generated after it carry versions of a timeline that was lost: they count as ``version``."""
    groups: dict[str, list[Trajectory]] = {}
    for trajectory in consumer.pending():
        groups.setdefault(trajectory.group_id, []).append(trajectory)
    return [Episode(group, min(version, *(t.version_range[0] for t in group))) for group in groups.values()]
