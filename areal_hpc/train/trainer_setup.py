"""A trainer rank's start: join the process group, build the mesh, load the actor (and, when the
config asks for them, a frozen reference for the KL penalty and a critic for PPO with GAE).

Every rank builds the same engines from ``model.path``; the launcher points it at the SFT warm-up
output (or the run's initial model) and ``--resume`` then loads the checkpoint over it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_hpc.config import RunConfig
from areal_hpc.errors import UserError
from areal_hpc.models.hf import load_critic, load_model, load_tokenizer
from areal_hpc.parallel.device import resolve_device
from areal_hpc.parallel.mesh import ParallelDims, init_distributed
from areal_hpc.train.actor import PPOActor
from areal_hpc.train.engine import TorchTrainEngine
from areal_hpc.train.logprobs import packed_token_logprobs, packed_values


def start_trainer(cfg: RunConfig) -> tuple[int, torch.device, dist.ProcessGroup]:
    """(rank, device, data-parallel group) of this process."""
    device = resolve_device(cfg.cluster.device)
    rank, world = init_distributed(device)
    dims = ParallelDims(dp=world)
    dims.check(world)
    return rank, device, dims.build_mesh(device)["dp"].get_group()


def build_actor(cfg: RunConfig, device: torch.device, dp_group) -> tuple[PPOActor, dict[str, TorchTrainEngine]]:
    if not cfg.model.path:
        raise UserError("the trainer needs model.path=DIR (the launcher sets it to the run's starting model)")
    path, model, actor_cfg = cfg.model.path, cfg.model, cfg.actor
    tokenizer = load_tokenizer(cfg.tokenizer.path or path)
    optimizer_steps = cfg.rl.total_train_steps * min(actor_cfg.ppo_n_minibatches, cfg.rollout.consumer_batch_size)

    def engine(network, forward_fn, lr=None):
        return TorchTrainEngine(network, forward_fn, optimizer=cfg.optimizer if lr else None, lr=lr or 0.0,
                                total_steps=optimizer_steps, max_tokens_per_mb=actor_cfg.max_tokens_per_mb,
                                dp_group=dp_group, tokenizer=tokenizer)

    engines = {"actor": engine(load_model(path, model.dtype, model.attn_impl, device), packed_token_logprobs,
                               actor_cfg.lr)}
    if actor_cfg.adv_estimator == "ppo":
        torch.manual_seed(cfg.experiment.seed)  # the value head's initialisation depends on the seed only
        engines["critic"] = engine(load_critic(path, model.dtype, model.attn_impl, device), packed_values,
                                   actor_cfg.critic_lr)
    reference = None
    if actor_cfg.kl_ctl > 0:  # frozen starting weights; not checkpointed (it never changes)
        reference = engine(load_model(path, model.dtype, model.attn_impl, device).requires_grad_(False),
                           packed_token_logprobs)
    return PPOActor(engines["actor"], actor_cfg, reference, engines.get("critic"), dp_group), engines
