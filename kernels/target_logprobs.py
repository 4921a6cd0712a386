"""Log-probability of each target token and the entropy, under softmax(hidden @ weight^T / T), without the
[N, V] logits in memory at once: the trainer's LM head for RL (decoupled PPO needs log p_T(token), the
logs want the entropy).

Rows go a chunk at a time (at most ``LOGITS_CHUNK_BYTES`` of logits): cuBLAS computes the chunk's logits,
then one Triton program per row walks the vocabulary in tiles with an online log-sum-exp, keeping the
target's logit and Σ e^z·z for the entropy. The backward pass recomputes the chunk's logits and a second
kernel overwrites them in place with d(loss)/d(logits), which two matmuls turn into the gradients of
hidden and weight. ``target_logprobs_entropy_reference`` is the same math in plain torch (that of
``areal_hpc.engines.torch.outputs``, entropy differentiable here), the one the kernel is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOGITS_CHUNK_BYTES = 256 * 2**20
BLOCK_V = 2048  # vocabulary tile of one row program


def target_logprobs_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p_T(tokens), entropy of p_T), each [N] float32, p_T = softmax(hidden @ weight^T / T) for
    hidden [N, Hd], weight [V, Hd], tokens [N], T one for all rows or each row's [N]; full logits."""
    logits = (hidden @ weight.to(hidden.dtype).T).float() / _row_temperatures(temperatures, hidden)[:, None]
    normaliser = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, tokens[:, None])[:, 0] - normaliser
    entropy = normaliser - (logits.softmax(-1) * logits).sum(-1)
    return logprobs, entropy


def _row_temperatures(temperatures: torch.Tensor | float, hidden: torch.Tensor) -> torch.Tensor:
    """[N] float32 temperatures from a number, [N] or [N, 1]."""
    return torch.as_tensor(temperatures, dtype=torch.float32, device=hidden.device).reshape(-1).expand(len(hidden))


@triton.jit
def _row_statistics(
    logits_ptr, tokens_ptr, inv_temperatures_ptr, logprobs_ptr, entropy_ptr, lse_ptr, V, BLOCK_V: tl.constexpr
):
    """One program per row of a [rows, V] logits chunk: log p(target), entropy, log-sum-exp of z = logits / T.
    Each lane keeps its own running max, Σ e^(z - max) and Σ e^(z - max)·z; lanes merge at the end."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * V
    inv_temperature = tl.load(inv_temperatures_ptr + row)
    target = tl.load(tokens_ptr + row)
    lane_max = tl.full([BLOCK_V], -1.0e30, dtype=tl.float32)  # finite: empty lanes give 0, not NaN
    lane_sum = tl.zeros([BLOCK_V], dtype=tl.float32)
    lane_weighted = tl.zeros([BLOCK_V], dtype=tl.float32)
    lane_target = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        columns = v0 + tl.arange(0, BLOCK_V)
        inside = columns < V
        z = tl.load(base + columns, mask=inside, other=0.0).to(tl.float32) * inv_temperature
        z = tl.where(inside, z, float("-inf"))
        new_max = tl.maximum(lane_max, z)
        correction = tl.exp(lane_max - new_max)
        e = tl.exp(z - new_max)
        lane_sum = lane_sum * correction + e
        lane_weighted = lane_weighted * correction + e * tl.where(inside, z, 0.0)
        lane_max = new_max
        lane_target += tl.where(columns == target, z, 0.0)
    row_max = tl.max(lane_max)
    lane_scale = tl.exp(lane_max - row_max)
    total = tl.sum(lane_sum * lane_scale)
    lse = row_max + tl.log(total)
    tl.store(lse_ptr + row, lse)
    tl.store(logprobs_ptr + row, tl.sum(lane_target) - lse)
    tl.store(entropy_ptr + row, lse - tl.sum(lane_weighted * lane_scale) / total)


@triton.jit
def _logit_gradients(
    logits_ptr,
    tokens_ptr,
    inv_temperatures_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    V,
    BLOCK_V: tl.constexpr,
):
    """One program per row, in place: logits -> d(loss)/d(logits) = (g_lp (1[v = target] - p_v)
    - g_H p_v (log p_v + H)) / T, from the forward's log-sum-exp and entropy H."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * V
    inv_temperature = tl.load(inv_temperatures_ptr + row)
    target = tl.load(tokens_ptr + row)
    lse, entropy = tl.load(lse_ptr + row), tl.load(entropy_ptr + row)
    grad_logprob, grad_entropy = tl.load(grad_logprobs_ptr + row), tl.load(grad_entropy_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        columns = v0 + tl.arange(0, BLOCK_V)
        inside = columns < V
        logp = tl.load(base + columns, mask=inside, other=0.0).to(tl.float32) * inv_temperature - lse
        p = tl.exp(logp)
        grad = grad_logprob * (tl.where(columns == target, 1.0, 0.0) - p) - grad_entropy * p * (logp + entropy)
        tl.store(base + columns, grad * inv_temperature, mask=inside)


def _chunks(hidden: torch.Tensor, vocabulary: int, chunk_bytes: int):
    """Row slices whose [rows, V] logits in hidden's dtype take at most chunk_bytes."""
    rows = max(1, chunk_bytes // (hidden.element_size() * vocabulary))
    return [slice(start, start + rows) for start in range(0, len(hidden), rows)]


class _TargetLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, inv_temperatures, chunk_bytes):
        vocabulary = len(weight)
        logprobs, entropy, lse = (torch.empty(len(hidden), dtype=torch.float32, device=hidden.device) for _ in range(3))
        for rows in _chunks(hidden, vocabulary, chunk_bytes):
            logits = hidden[rows] @ weight.T
            _row_statistics[(len(logits),)](
                logits,
                tokens[rows],
                inv_temperatures[rows],
                logprobs[rows],
                entropy[rows],
                lse[rows],
                vocabulary,
                BLOCK_V=BLOCK_V,
            )
        ctx.save_for_backward(hidden, weight, tokens, inv_temperatures, lse, entropy)
        ctx.chunk_bytes = chunk_bytes
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, tokens, inv_temperatures, lse, entropy = ctx.saved_tensors
        grad_logprobs, grad_entropy = grad_logprobs.float().contiguous(), grad_entropy.float().contiguous()
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)  # accumulated chunk by chunk in weight's dtype
        for rows in _chunks(hidden, len(weight), ctx.chunk_bytes):
            grad_logits = hidden[rows] @ weight.T
            _logit_gradients[(len(grad_logits),)](
                grad_logits,
                tokens[rows],
                inv_temperatures[rows],
                lse[rows],
                entropy[rows],
                grad_logprobs[rows],
                grad_entropy[rows],
                len(weight),
                BLOCK_V=BLOCK_V,
            )
            torch.mm(grad_logits, weight, out=grad_hidden[rows])
            grad_weight.addmm_(grad_logits.T, hidden[rows])
        return grad_hidden, grad_weight, None, None, None


def target_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    temperatures: torch.Tensor | float = 1.0,
    chunk_bytes: int = LOGITS_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p_T(tokens), entropy of p_T), each [N] float32, p_T = softmax(hidden @ weight^T / T) for
    hidden [N, Hd], weight [V, Hd] (an LM head without bias), tokens [N], T one for all rows or each row's
    ([N] or [N, 1]). Logits in hidden's dtype (weight is cast to it), softmax in float32; differentiable in
    hidden and weight through both outputs."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or tokens.shape != hidden.shape[:1]:
        raise ValueError(
            f"target_logprobs_entropy takes hidden [N, Hd], weight [V, Hd], tokens [N]; got hidden "
            f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}, tokens {tuple(tokens.shape)}"
        )
    inv_temperatures = (1 / _row_temperatures(temperatures, hidden)).contiguous()
    return _TargetLogprobsEntropy.apply(
        hidden.contiguous(), weight.to(hidden.dtype).contiguous(), tokens.contiguous(), inv_temperatures, chunk_bytes
    )
