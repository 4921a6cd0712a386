"""Megatron's forward/backward schedule over a rank's packed micro-batches ("passes"): the passes cut
from its share of a batch, run as THD ``PackedSeqParams`` through ``get_forward_backward_func``
(variable sequence lengths across pipeline stages), and the last stage's results sent to every stage.

- DDP's reduction runs after the last micro-batch, so data-parallel ranks may run different numbers
  of them (or none) -- except under expert parallelism, where every MoE layer exchanges tokens over
  the expert-parallel ranks, and under FSDP, whose every pass gathers and reduces: a rank out of
  micro-batches runs idle ones (two tokens, nothing added to the gradients) until its peers are done.
- With virtual pipeline stages (``vpp``), Megatron's interleaved 1F1B takes micro-batches in groups
  of pp: idle passes complete the last group.
- Under context parallelism every sequence of a micro-batch is padded at its end to a multiple of
  2 x cp tokens and dealt in zig-zag chunks over the cp ranks (``parallel.context``): Megatron's
  rotary embedding for packed sequences takes exactly those equal chunks, the core attention gathers
  keys and values over the cp ranks, and per-position fields and outputs are split and gathered with
  the tokens.
- Sequence parallelism (Megatron's own: norms and residuals on a TP rank's slice of the tokens) needs
  each rank's tokens of a pass to split evenly over the TP ranks: with cp, sequences are padded to a
  multiple of 2 x cp x tp; without, a filler sequence (no targets) ends the pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from areal_hpc.algo.packing import PackedBatch, dynamic_microbatches, pack, with_filler
from areal_hpc.engines.base import Outputs
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.parallel.context import context_passes
from areal_hpc.parallel.mesh import TrainMesh

Pass = tuple[list[int], PackedBatch, dict[str, torch.Tensor]]  # (sequence indices, micro-batch, packed fields)


def microbatches(batch: SequenceBatch, mesh: TrainMesh, max_tokens_per_mb: int, *, sharded: bool) -> list[Pass]:
    """The passes of this rank's share ``batch``; under expert parallelism or FSDP (``sharded``) then
    idle passes (no indices) up to the most any data-parallel peer has; under context parallelism each
    pass's share of this cp rank. Under sequence parallelism each rank's tokens of a pass split evenly
    over the TP ranks: sequences are padded (with cp) or a filler sequence ends the pass."""
    passes = []
    for indices in dynamic_microbatches([len(s) for s in batch.sequences], max_tokens_per_mb):
        packed, fields = batch.select(indices).packed()
        passes.append((indices, packed.to(mesh.device), {k: v.to(mesh.device) for k, v in fields.items()}))

    def idle() -> Pass:
        """The pass of a rank out of micro-batches."""
        return [], pack([[0, 0]], [[0, 1]]).to(mesh.device), {}

    if mesh.dims.ep > 1 or sharded:
        count = torch.tensor(len(passes), device=mesh.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=mesh.group("dp"))
        passes += [idle()] * (int(count) - len(passes))
    if mesh.dims.vpp > 1 and passes:  # the interleaved schedule runs micro-batches in groups of pp
        passes += [idle()] * (-len(passes) % mesh.dims.pp)
    dims = mesh.dims
    tp_split = dims.tp if dims.sequence_parallel else 1
    if dims.cp > 1:
        passes = context_passes(
            passes, dims.cp, mesh.coords["cp"], mesh.group("cp"), pad_multiple=2 * dims.cp * tp_split
        )
    elif tp_split > 1:
        passes = [
            (indices, with_filler(packed, tp_split), {k: F.pad(v, (0, -len(v) % tp_split)) for k, v in fields.items()})
            for indices, packed, fields in passes
        ]
    return passes


def run_schedule(
    roots: list,
    passes: list[Pass],
    head_input_of: Callable[[PackedBatch], object],
    outputs_of: Callable[[torch.Tensor, PackedBatch], Outputs],
    on_outputs: Callable[[list[int], Outputs, PackedBatch, dict[str, torch.Tensor]], torch.Tensor],
    *,
    forward_only: bool,
) -> None:
    """Megatron's schedule of the (wrapped) model chunks ``roots`` over ``passes`` (interleaved 1F1B with
    several chunks: each reads every pass, for its positions and sequence boundaries); the last stage's
    output layer takes ``head_input_of(packed)`` (as GPTModel's ``runtime_gather_output``, which it hands on
    untouched; made only there), the stage turns each pass's output into ``outputs_of(output, packed)`` and calls
    ``on_outputs(indices, outputs, packed, fields)`` for each pass with sequences, which returns the
    micro-batch's loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_attr_wrapped_model

    from areal_hpc.engines.megatron.attention import PackedSequences

    def step(iterator, model):
        indices, packed, fields = next(iterator)
        sequences = PackedSequences.of(packed)
        last = get_attr_wrapped_model(model, "post_process")
        stage_output = model(
            packed.input_ids,
            packed.position_ids,
            None,
            packed_seq_params=sequences,
            runtime_gather_output=head_input_of(packed) if last else None,
        )

        def loss(output):
            outputs = outputs_of(output, packed)
            if not indices:  # an idle pass: its backward still runs the experts' exchanges, adding 0
                return sum(values.sum() for values in outputs.values()) * 0.0, torch.tensor(1), {}
            return on_outputs(indices, outputs, packed, fields), torch.tensor(1), {}

        return stage_output, loss

    if not passes:
        return
    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=[iter(passes) for _ in roots],
        model=roots,
        num_microbatches=len(passes),
        seq_length=max(p.input_ids.shape[1] for _, p, _ in passes),
        micro_batch_size=1,
        forward_only=forward_only,
    )


def from_last_stage(value, mesh: TrainMesh, pp_group):
    """``value`` of the last pipeline stage, on every stage."""
    if mesh.dims.pp == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pp_group, mesh.dims.pp - 1), group=pp_group)
    return box[0]
