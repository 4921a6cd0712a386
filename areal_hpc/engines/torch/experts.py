"""Expert parallelism for the PyTorch-native engine: the experts of a Hugging Face Mixture-of-Experts
model (Qwen3-MoE's ``Experts`` modules: 3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I])
split over ``mesh["ep"]``, each rank holding E / ep of them, and tokens sent to their experts' ranks.

Every rank routes its own tokens (the router is an ordinary replicated layer); per MoE layer, the
(token, expert) assignments go to the ranks that hold those experts and the results come back, by
two differentiable ``all_to_all_single`` exchanges (functional collectives) with uneven splits (nothing padded, no
capacity
factor, no token dropped): the same sum as the model's own expert loop, in another order.

The expert weights are DTensors sharded on dim 0 over the ep mesh, so the engine's full-state gather,
its loading of full tensors and its gradient norm need nothing new. They are left out of the data-
parallel wrapping (their gradients are complete sums over the ep group already); over ``edp``, the
ranks holding the same experts, they are summed by ``reduce_expert_gradients``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from areal_hpc.errors import UserError
from areal_hpc.parallel.mesh import TrainMesh

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that hold a layer's experts as 3-D weights."""
    return [
        m
        for m in model.modules()
        if all(isinstance(getattr(m, w, None), torch.nn.Parameter) and getattr(m, w).dim() == 3 for w in EXPERT_WEIGHTS)
    ]


def check_experts(model: torch.nn.Module, ep: int, tp: int) -> None:
    """Raise ``UserError`` when the model's experts cannot be split ``ep`` ways."""
    experts = expert_modules(model)
    if not experts:
        raise UserError(
            f"actor.parallel.ep={ep} needs a Mixture-of-Experts model (e.g. Qwen3-MoE); "
            f"{type(model).__name__} has no experts"
        )
    if tp > 1:
        raise UserError(
            f"actor.engine=torch does not split experts by tensor parallelism: with "
            f"actor.parallel.ep={ep} set tp=1 (or use actor.engine=megatron)"
        )
    count = experts[0].gate_up_proj.shape[0]
    if count % ep:
        raise UserError(f"actor.parallel.ep={ep} must divide the model's num_experts={count}")


class ExpertParallelForward:
    """The forward of one experts module with its weights sharded over the ep group."""

    def __init__(self, module: torch.nn.Module, mesh: TrainMesh):
        self.module, self.group = module, mesh.group("ep")
        self.ep, self.rank = mesh.dims.ep, mesh.coords["ep"]
        self.local_experts = module.gate_up_proj.shape[0] // self.ep

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [N, H], the chosen experts [N, k] and their weights [N, k] -> [N, H]."""
        tokens = torch.arange(len(hidden), device=hidden.device).repeat_interleave(top_k_index.shape[1])
        experts, weights = top_k_index.reshape(-1), top_k_weights.reshape(-1)
        order = torch.argsort(experts, stable=True)  # assignments grouped by destination rank
        tokens, experts, weights = tokens[order], experts[order], weights[order]
        sent = torch.bincount(experts // self.local_experts, minlength=self.ep)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        sent, received = sent.tolist(), received.tolist()
        local_ids = torch.empty(sum(received), dtype=experts.dtype, device=experts.device)
        dist.all_to_all_single(local_ids, experts % self.local_experts, received, sent, group=self.group)
        rows = functional.all_to_all_single(hidden[tokens], received, sent, self.group)
        results = self._compute(rows, local_ids)
        back = functional.all_to_all_single(results, sent, received, self.group)
        out = torch.zeros_like(hidden)
        return out.index_add(0, tokens, (back * weights[:, None]).to(out.dtype))

    def _compute(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each received row through its expert. Every expert runs, on no rows if none came: the result
        then still depends on the received rows and the weights, so this rank's backward takes part in
        both exchanges' backward even when no token chose its experts (else the peers wait forever)."""
        gate_up, down = (getattr(self.module, w).to_local() for w in EXPERT_WEIGHTS)
        out = rows.new_zeros(rows.shape)
        for expert in range(self.local_experts):
            mine = (local_ids == expert).nonzero()[:, 0]
            gate, up = torch.nn.functional.linear(rows[mine], gate_up[expert]).chunk(2, dim=-1)
            value = torch.nn.functional.linear(self.module.act_fn(gate) * up, down[expert])
            out = out.index_copy(0, mine, value.to(out.dtype))
        return out


def shard_experts(model: torch.nn.Module, mesh: TrainMesh) -> list[torch.nn.Parameter]:
    """Split every experts module's weights over ``mesh["ep"]`` (in place; collective); returns the
    expert parameters (to be left out of data-parallel wrapping)."""
    check_experts(model, mesh.dims.ep, mesh.dims.tp)
    params = []
    for module in expert_modules(model):
        for name in EXPERT_WEIGHTS:
            full = getattr(module, name)
            sharded = torch.nn.Parameter(
                distribute_tensor(full.data, mesh["ep"], [Shard(0)], src_data_rank=None),
                requires_grad=full.requires_grad,
            )
            setattr(module, name, sharded)
            params.append(sharded)
        module.forward = ExpertParallelForward(module, mesh)
    return params


@torch.no_grad()
def reduce_expert_gradients(params: list[torch.nn.Parameter], mesh: TrainMesh) -> None:
    """Sum the expert gradients over the ranks that hold the same experts (``edp``)."""
    if mesh.size("edp") == 1:
        return
    for param in params:
        if param.grad is not None:
            grad = param.grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=mesh.group("edp"))
