"""Checkpoints of the Megatron model in Hugging Face folders: this rank's shards loaded from a folder
(any layout saved it; the rank reads its own stage's tensors only), the whole model gathered stage by stage
onto global rank 0 in buckets (for the rollout push and the saved folder), and the optimizer state saved and
resumed per rank.

- A critic's head the folder lacks takes the same draws as ``models.hf.load_critic``'s, so both
  engines start from one critic.
- Optimizer state resumes in the layout that saved it only; FSDP's Adam moments are DTensor shards,
  saved per rank as their local shards. In bf16 it is Megatron's mixed-precision optimizer's: the fp32
  master weights beside the torch optimizer's state.
- The distributed optimizer's (ZeRO-1) state is gathered over the dp x cp ranks into Megatron's
  "dp_zero" format (each model-parallel rank's buffer of fp32 master weights and Adam moments, without
  the padding that depends on the data-parallel size), one file per tp x pp rank, and scattered back:
  it resumes in any data-parallel size.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from areal_hpc.engines.base import OPTIMIZER_SHARDS, TRAINING_STATE, WeightBucket, weight_buckets
from areal_hpc.engines.megatron.convert import ModelShape, hf_to_megatron, is_expert, stage_to_hf
from areal_hpc.engines.megatron.model import PipelineStage
from areal_hpc.errors import UserError
from areal_hpc.layout import ParallelDims
from areal_hpc.models.hf import fresh_value_head, save_model
from areal_hpc.models.hub_checkpoint import HubCheckpoint
from areal_hpc.parallel.mesh import TrainMesh


class StoredTensors(dict):
    """A Hugging Face folder's tensors as the dict ``hf_to_megatron`` reads, each read from its file when the
    converter asks for it (``models.hub_checkpoint``): a rank reads the whole tensors of its own stage, never
    the others'. The last one read is kept, as the converter cuts every expert of a layer from one fused tensor."""

    def __init__(self, checkpoint: HubCheckpoint, extra: dict[str, torch.Tensor]):
        super().__init__(extra)
        self.checkpoint, self.last = checkpoint, ("", torch.empty(0))

    def __missing__(self, name: str) -> torch.Tensor:
        if self.last[0] != name:
            self.last = (name, self.checkpoint.read(name))
        return self.last[1]

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name) or (isinstance(name, str) and name in self.checkpoint)


def state_names(model) -> list[str]:
    """The names of ``model``'s state dict that hold weights (Transformer Engine's extra state left out)."""
    return [n for n in model.state_dict() if not n.endswith("_extra_state")]


@torch.no_grad()
def load_hf_weights(
    stage: PipelineStage, folder: Path, hf_config, shape: ModelShape, mesh: TrainMesh, *, critic: bool
) -> None:
    """This rank's shards of the Hugging Face weights in ``folder`` into each chunk of pipeline stage
    ``stage`` (the layers of its virtual stage); a critic's head the folder lacks is drawn afresh."""
    checkpoint = HubCheckpoint(folder)
    fresh = critic and "score.weight" not in checkpoint  # a critic starting from the policy's folder
    hf_state = StoredTensors(checkpoint, fresh_value_head(hf_config) if fresh else {})
    dims, coords = mesh.dims, mesh.coords
    for model, virtual in zip(stage.chunks, stage.virtual_stages(), strict=True):
        try:
            state = hf_to_megatron(
                hf_state, shape, coords["tp"], dims.tp, virtual, dims.pp * dims.vpp, ep_rank=coords["ep"], ep=dims.ep
            )
        except KeyError as missing:
            raise RuntimeError(f"checkpoint {folder} lacks {missing}") from None
        names = state_names(model)
        if sorted(state) != sorted(names):
            raise RuntimeError(
                f"Megatron virtual stage {virtual} has {sorted(set(names) ^ set(state))[:5]} beyond the "
                "converter's names"
            )
        for name, tensor in model.state_dict().items():
            if isinstance(tensor, DTensor):  # FSDP's shard: every rank cuts its own from the full tensor
                tensor.copy_(
                    distribute_tensor(
                        state[name].to(tensor.device), tensor.device_mesh, tensor.placements, src_data_rank=None
                    )
                )
            elif name in state:
                tensor.copy_(state[name])


def stage_hf_tensors(stage: PipelineStage, shape: ModelShape, mesh: TrainMesh) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of this stage's chunks on the stage's first replica's TP rank 0: FSDP's
    shards gathered by every replica, then TP shards over the first replica, experts over the TP and EP
    ranks of the first expert replica (the other ranks of those take part and get nothing; other
    replicas do nothing more)."""
    from megatron.core import parallel_state

    coords = mesh.coords
    first_replica = coords["dp"] == coords["cp"] == 0
    takes_part = {False: first_replica, True: coords["edp"] == 0}  # keyed by: is it an expert's?
    groups = {False: stage.tp_group, True: parallel_state.get_expert_tensor_and_model_parallel_group()}

    def gathered(model) -> Iterator[tuple[str, list[torch.Tensor]]]:
        state = model.state_dict()
        for name in state_names(model):
            local = state[name].detach()
            local = local.full_tensor() if isinstance(local, DTensor) else local
            expert = is_expert(name)
            if not takes_part[expert]:
                continue
            local = local.contiguous()
            shards = [torch.empty_like(local) for _ in range(dist.get_world_size(groups[expert]))]
            dist.all_gather(shards, local, group=groups[expert])  # EP rank major, then TP rank
            yield name, shards

    for model, virtual in zip(stage.chunks, stage.virtual_stages(), strict=True):
        if first_replica and coords["tp"] == 0:
            yield from stage_to_hf(gathered(model), shape, virtual, mesh.dims.pp * mesh.dims.vpp, mesh.dims.ep)
        else:
            for _ in gathered(model):
                pass


def buckets_on_rank0(
    stage_tensors: Iterator[tuple[str, torch.Tensor]], mesh: TrainMesh, pp_group, bucket_bytes: int
) -> Iterator[WeightBucket]:
    """Buckets of the whole model on global rank 0: its own stage's ``stage_tensors``, then each later
    stage's leader sends its buckets (``None`` ends a stage). Collective: every rank iterates to the
    end; the others' buckets are empty."""
    leader = mesh.coords["dp"] == mesh.coords["cp"] == mesh.coords["tp"] == 0
    buckets = weight_buckets(stage_tensors, bucket_bytes)
    if dist.get_rank() == 0:
        yield from buckets
        for stage in range(1, mesh.dims.pp):
            source = dist.get_global_rank(pp_group, stage)
            while (bucket := _receive(source)) is not None:
                yield bucket
    elif leader:
        for bucket in buckets:
            dist.send_object_list([bucket], dst=0)
        dist.send_object_list([None], dst=0)
    else:
        for _ in buckets:
            pass


def save_hf_folder(buckets: Iterator[WeightBucket], folder: Path, hf_config, tokenizer, *, critic: bool) -> None:
    """Collective over ``buckets_on_rank0``'s ``buckets``: rank 0 writes them as the Hugging Face folder
    of a causal LM (or with ``critic``, a token classifier)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    state = {name: tensor for bucket in buckets for name, tensor in bucket}
    if dist.get_rank() == 0:
        with torch.device("meta"):
            kind = AutoModelForTokenClassification if critic else AutoModelForCausalLM
            skeleton = kind.from_config(hf_config)
        save_model(skeleton, tokenizer, folder, state_dict=state)


def save_optimizer_state(folder: Path, optimizer, scheduler, dims: ParallelDims) -> None:
    """Collective, once rank 0 has written ``folder``: every rank its optimizer state
    (``optimizer/rank{N}.pt``), rank 0 the schedule and layout (``training_state.pt``)."""
    rank = dist.get_rank()
    dist.barrier()  # rank 0 has renamed the folder into place
    (folder / OPTIMIZER_SHARDS).mkdir(exist_ok=True)
    training = {"scheduler": scheduler.state_dict(), "megatron_layout": megatron_layout(dims, optimizer)}
    if is_distributed(optimizer):
        _with_adam_state(optimizer)  # a run saved before its first step: zero moments
        gathered = optimizer.get_parameter_state_dp_zero()  # collective over dp x cp; None but on its rank 0
        if gathered is not None:
            torch.save(gathered, folder / OPTIMIZER_SHARDS / _model_parallel_file())
        training["optimizer_groups"] = [
            {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
        ]
        training["optimizer_step"] = _adam_step(optimizer)
    else:
        state = optimizer.state_dict()
        torch.save(_local_shards(state) if dims.fsdp else state, folder / OPTIMIZER_SHARDS / f"rank{rank}.pt")
    if rank == 0:
        torch.save(training, folder / TRAINING_STATE)


def load_optimizer_state(folder: Path, optimizer, scheduler, dims: ParallelDims, device: torch.device) -> None:
    """This rank's optimizer state and the schedule from ``folder``, which a run of this layout saved (with
    the distributed optimizer: of this layout but for the data-parallel size)."""
    training = torch.load(folder / TRAINING_STATE, map_location="cpu", weights_only=True)
    saved = training.get("megatron_layout")
    if saved:  # checkpoints from before cp, fsdp, bf16, the distributed optimizer
        saved = {"cp": 1, "fsdp": 0, "bf16": 0, "distributed_optimizer": 0, **saved}
    if not _resumable(saved, megatron_layout(dims, optimizer)):
        raise UserError(
            f"checkpoint {folder} holds optimizer state of layout {saved}, not this run's "
            f"{megatron_layout(dims, optimizer)} (actor.engine=megatron resumes in the layout it saved; "
            "with actor.parallel.distributed_optimizer=true, in any dp)"
        )
    scheduler.load_state_dict(training["scheduler"])
    if is_distributed(optimizer):
        _load_distributed_state(optimizer, folder, training)
        return
    shard = torch.load(folder / OPTIMIZER_SHARDS / f"rank{dist.get_rank()}.pt", map_location=device, weights_only=True)
    if has_master_weights(optimizer):
        _load_mixed_precision_state(optimizer, shard)
    else:
        optimizer.load_state_dict(shard)
    _placed_like_parameters(optimizer)


def has_master_weights(optimizer) -> bool:
    """Whether ``optimizer`` keeps fp32 masters of bf16 parameters (Megatron's mixed-precision optimizer,
    or its distributed optimizer in bf16)."""
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    return isinstance(optimizer, MixedPrecisionOptimizer) and optimizer.config.bf16


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is Megatron's distributed optimizer (ZeRO-1)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer)


def megatron_layout(dims: ParallelDims, optimizer) -> dict[str, int]:
    """The layout an optimizer checkpoint records, and must match to resume (bf16: fp32 master weights)."""
    return {
        "dp": dims.dp,
        "tp": dims.tp,
        "pp": dims.pp,
        "cp": dims.cp,
        "ep": dims.ep,
        "fsdp": int(dims.fsdp),
        "bf16": int(has_master_weights(optimizer)),
        "distributed_optimizer": int(is_distributed(optimizer)),
    }


def _resumable(saved: dict | None, current: dict) -> bool:
    """Whether optimizer state saved in layout ``saved`` resumes in ``current``: the same layout, where
    the distributed optimizer saved and resumes it any dp."""
    if saved and saved["distributed_optimizer"] and current["distributed_optimizer"]:
        return {**saved, "dp": current["dp"]} == current
    return saved == current


def _model_parallel_file() -> str:
    """The distributed optimizer's file of this rank's tp x pp coordinates (shared by its dp x cp ranks)."""
    from megatron.core import parallel_state

    return (
        f"tp{parallel_state.get_tensor_model_parallel_rank()}_pp{parallel_state.get_pipeline_model_parallel_rank()}.pt"
    )


def _with_adam_state(optimizer) -> None:
    """The distributed optimizer's shards with Adam state (zero moments at step 0 where they have none yet:
    a run that has not stepped), which Megatron's gather and scatter read and write in place."""
    inner = optimizer.optimizer
    for group in inner.param_groups:
        for shard in group["params"]:
            if not inner.state[shard]:
                inner.state[shard] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(shard),
                    "exp_avg_sq": torch.zeros_like(shard),
                }


def _adam_step(optimizer) -> float:
    """The step count of the distributed optimizer's Adam (the same on every shard)."""
    return max((float(state["step"]) for state in optimizer.optimizer.state.values()), default=0.0)


@torch.no_grad()  # in float32 the master weights are views of the parameters
def _load_distributed_state(optimizer, folder: Path, training: dict) -> None:
    """The distributed optimizer's state from ``folder``: its dp x cp rank 0 reads the tp x pp file and
    Megatron scatters each rank's shard of it; the parameter groups' settings (the learning rate) and
    Adam's step count from ``training``."""
    _with_adam_state(optimizer)
    for state in optimizer.state.values():  # Megatron's scatter fills every tensor of an entry: the step is not one
        del state["step"]
    first = optimizer.data_parallel_group_gloo.rank() == 0
    gathered = (
        torch.load(folder / OPTIMIZER_SHARDS / _model_parallel_file(), map_location="cpu", weights_only=True)
        if first
        else None
    )
    optimizer.load_parameter_state_from_dp_zero(gathered)
    for state in optimizer.state.values():
        state["step"] = torch.tensor(training["optimizer_step"])
    for group, saved in zip(optimizer.param_groups, training["optimizer_groups"], strict=True):
        group.update(saved)


def _load_mixed_precision_state(optimizer, state: dict) -> None:
    """Megatron's mixed-precision optimizer state (its ``state_dict()``) into ``optimizer``: the torch
    optimizer's, then the fp32 master weights. (Megatron's own ``load_state_dict`` matches parameter
    groups by Megatron's group keys, which ``engines.optim``'s groups do not carry.)"""
    optimizer.optimizer.load_state_dict(state["optimizer"])
    with torch.no_grad():
        for masters, saved in zip(optimizer.fp32_from_float16_groups, state["fp32_from_fp16_params"], strict=True):
            for master, value in zip(masters, saved, strict=True):
                master.copy_(value)


def _local_shards(state: dict) -> dict:
    """An optimizer state dict with FSDP's DTensors as this rank's local shards (what its file holds)."""
    local = {
        key: {name: value.to_local() if isinstance(value, DTensor) else value for name, value in entry.items()}
        for key, entry in state["state"].items()
    }
    return {**state, "state": local}


def _placed_like_parameters(optimizer: torch.optim.Optimizer) -> None:
    """After loading local shards: each FSDP-sharded parameter's moments become DTensors placed as the
    parameter is (its step count stays a plain tensor)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            entry = optimizer.state[param]
            for name, value in entry.items():
                if torch.is_tensor(value) and not isinstance(value, DTensor) and name != "step":
                    entry[name] = DTensor.from_local(
                        value,
                        param.device_mesh,
                        param.placements,
                        shape=param.shape,
                        stride=param.stride(),
                        run_check=False,
                    )


def _receive(source: int):
    box = [None]
    dist.recv_object_list(box, src=source)
    return box[0]
