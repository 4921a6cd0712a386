"""Log-probabilities of target tokens, and the entropy of the distribution they are drawn from, without the
[tokens x vocabulary] float32 logits in memory at once: the one implementation every path shares (the torch
engine's LM head, the Megatron engine's vocabulary-parallel output layer, the rollout server's prompt scoring).

Rows (hidden states under an LM head, or logits already computed) go a chunk of at most ``LOGITS_CHUNK_BYTES``
of float32 logits at a time. The forward pass keeps each row's log-normaliser and nothing of the chunk. The
backward pass recomputes a chunk's logits and overwrites them with d log p(token) / d logits = (onehot(token)
- p) / T, p from the normaliser, then forms the head's gradients from it: the hidden states' rows, and the
weight's and bias's sums added up in place chunk by chunk. For a 152k vocabulary and 4,096 tokens the whole
logits take 2.5 GB, and a plain log-softmax's intermediates as much again each; a chunk takes 128 MiB. The
price is one more product with the head (recomputing the logits): four instead of three.

Vocabulary-parallel logits (each tensor-parallel rank holds a slice of the columns) take the max and the
sums over the ranks per chunk, in the forward pass only: every rank computes the same loss from the summed
terms, so each rank's gradient is that of its own columns (as Megatron's
``reduce_from_tensor_model_parallel_region``, whose backward is the identity, gives it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

LOGITS_CHUNK_BYTES = 128 * 2**20  # read at each call: tests lower it to exercise several chunks
# Chunks of more rows than this hold a multiple of it: matrix products of whole tiles, and on a CPU (oneDNN
# builds a kernel per shape) shapes that repeat when the caller pads the rows to a multiple (the torch engine)
ROWS_MULTIPLE = 64


@dataclass(frozen=True)
class VocabularyShard:
    """This rank's slice of vocabulary-parallel logits: its columns are token ids ``first``.. ; ``group`` holds
    the ranks with the other slices."""

    first: int
    group: dist.ProcessGroup


def token_logprobs(
    rows: torch.Tensor,
    tokens: torch.Tensor,
    temperatures: torch.Tensor | float = 1.0,
    *,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    shard: VocabularyShard | None = None,
    chunk_bytes: int | None = None,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p_T(token), entropy of p_T) for each of ``rows``, p_T = softmax(logits / T): the logits are ``rows``
    [N, V] themselves, or with ``weight`` [V, H] those of an LM head on hidden states ``rows`` [N, H],
    ``rows @ weight.T + bias``, softcapped to ``softcap * tanh(logits / softcap)`` where ``softcap`` (Gemma's
    ``final_logit_softcapping``). ``tokens`` [N]: the targets; T: one for all rows or each row's ([N, 1]).
    In float32 (or the logits' dtype where wider); the logprobs are differentiable (in ``rows``, ``weight`` and
    ``bias``), the entropy is not. ``shard``: the logits are this rank's columns of vocabulary-parallel ones.
    ``chunk_bytes``: the float32 logits of one chunk (``LOGITS_CHUNK_BYTES`` by default). ``entropy=False``: an
    empty tensor in the entropy's place, one pass over each chunk fewer (scoring needs none)."""
    width = rows.shape[-1] if weight is None else len(weight)
    size = max(1, (LOGITS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * width))
    size -= size % ROWS_MULTIPLE if size > ROWS_MULTIPLE else 0
    exact = None if torch.is_tensor(temperatures) else torch.float64  # a number: cast to the logits' dtype alone
    temperatures = torch.as_tensor(temperatures, dtype=exact, device=rows.device).reshape(-1, 1).expand(len(rows), 1)
    how = _Chunking(size, softcap, shard, entropy)
    return _TokenLogprobs.apply(how, rows, tokens, temperatures, weight, bias)


@dataclass(frozen=True)
class _Chunking:
    size: int  # rows a chunk
    softcap: float | None
    shard: VocabularyShard | None
    entropy: bool


class _Scratch:
    """Chunk-sized tensors reused from one chunk to the next: a new [rows, V] tensor costs its page faults every
    time, as long as an elementwise pass over it."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, columns: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        held = self.held.get(name)
        if held is None or held.dtype != dtype or held.shape[1] != columns or len(held) < rows:
            held = self.held[name] = torch.empty(rows, columns, dtype=dtype, device=device)
        return held[:rows]


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, how: _Chunking, rows, tokens, temperatures, weight, bias):
        scratch = _Scratch()
        parts = []
        for chunk, chunk_tokens, chunk_temperatures in zip(
            rows.split(how.size), tokens.split(how.size), temperatures.split(how.size)
        ):
            logits = chunk if weight is None else _head(chunk, weight, bias, how.softcap, scratch)[0]
            parts.append(_statistics(how, logits, weight is not None, chunk_tokens, chunk_temperatures, scratch))
        empty = rows.new_zeros(0, dtype=torch.promote_types(rows.dtype, torch.float32))
        logprobs, entropy, normaliser = (torch.cat(p) for p in zip(*parts)) if parts else [empty] * 3
        entropy = entropy if how.entropy else empty
        ctx.save_for_backward(rows, tokens, temperatures, normaliser, weight, bias)
        ctx.how = how
        device = rows.device.type  # the backward recomputes the logits as the forward computed them
        ctx.autocast = device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        rows, tokens, temperatures, normaliser, weight, bias = ctx.saved_tensors
        how, (_, wants_rows, _, _, wants_weight, wants_bias) = ctx.how, ctx.needs_input_grad
        grad_rows = torch.empty_like(rows) if wants_rows else None  # every chunk writes its rows
        grad_weight = grad_bias = compute_weight = None
        scratch = _Scratch()
        device, dtype, enabled = ctx.autocast
        for start in range(0, len(rows), how.size):
            part = slice(start, start + how.size)
            chunk, capped = rows[part], None
            if weight is None:  # the rows are the logits: their gradient goes straight into grad_rows
                logits = chunk
            else:
                with torch.autocast(device, dtype=dtype, enabled=enabled):
                    logits, capped = _head(chunk, weight, bias, how.softcap, scratch)
            spare = grad_rows[part] if weight is None and wants_rows else None
            per_row = tokens[part], temperatures[part], normaliser[part], grad_logprobs[part]
            gradient = _logit_gradient(how, logits, weight is not None, per_row, scratch, spare)
            if weight is None:
                if wants_rows and gradient.data_ptr() != grad_rows[part].data_ptr():
                    grad_rows[part] = gradient
                continue
            if capped is not None:  # d softcap·tanh(y / softcap) / dy = 1 - tanh²
                gradient.mul_(capped.square_().neg_().add_(1))
            gradient = gradient.to(logits.dtype)  # the products in the forward's dtype (autocast's, if on)
            if compute_weight is None:
                compute_weight = weight.to(logits.dtype)
            if wants_rows:
                grad_rows[part] = gradient @ compute_weight
            if wants_weight:
                grad_weight = _accumulate(grad_weight, weight, gradient.T, chunk.to(logits.dtype))
            if wants_bias:
                grad_bias = gradient.sum(0).to(bias.dtype) if grad_bias is None else grad_bias.add_(gradient.sum(0))
        if wants_weight:
            grad_weight = torch.zeros_like(weight) if grad_weight is None else grad_weight.to(weight.dtype)
        if wants_bias and grad_bias is None:
            grad_bias = torch.zeros_like(bias)
        return None, grad_rows, None, None, grad_weight, grad_bias


def _head(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None, scratch: _Scratch
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the LM head's logits of ``hidden``, a tensor of this call's own; tanh(y / softcap) where softcapped, y the
    product). In ``scratch`` where autocast is off and the dtypes agree (a new tensor, made for each chunk, costs
    its page faults), else as ``F.linear`` makes them."""
    if torch.is_autocast_enabled(hidden.device.type) or hidden.dtype != weight.dtype:
        logits = F.linear(hidden, weight, bias)
    else:
        out = scratch.get("logits", len(hidden), len(weight), weight.dtype, hidden.device)
        logits = torch.mm(hidden, weight.T, out=out) if bias is None else torch.addmm(bias, hidden, weight.T, out=out)
    if not softcap:
        return logits, None
    capped = torch.tanh(logits.div_(softcap))
    return logits.copy_(capped).mul_(softcap), capped


def _accumulate(total: torch.Tensor | None, like: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``total`` + a @ b in ``like``'s dtype, or float32 where that is narrower (bf16 weights: the chunks' sum
    rounded once, at the end, as one product over all the rows is): in place where the product's dtype is that
    one."""
    if total is None:
        return (a @ b).to(torch.promote_types(like.dtype, torch.float32))
    return total.addmm_(a, b) if a.dtype == total.dtype else total.add_(a @ b)


def _float(logits: torch.Tensor) -> torch.dtype:
    """The dtype logprobs are computed in: float32, or the logits' where wider."""
    return torch.promote_types(logits.dtype, torch.float32)


def _shifted(
    logits: torch.Tensor,
    own: bool,
    temperatures: torch.Tensor,
    offset: torch.Tensor,
    scratch: _Scratch,
    spare: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits / T - offset ([n, 1]) in ``_float`` in one pass: in place where the logits are ``own`` (a new
    tensor of that dtype), else in ``spare`` where it has that dtype, else in ``scratch``."""
    dtype = _float(logits)
    if own and logits.dtype == dtype:
        out = logits
    else:
        out = (
            spare
            if spare is not None and spare.dtype == dtype
            else scratch.get("shifted", len(logits), logits.shape[1], dtype, logits.device)
        )
    return torch.addcmul(-offset.to(dtype), logits, temperatures.to(dtype).reciprocal(), out=out)


def _columns(tokens: torch.Tensor, width: int, shard: VocabularyShard | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's column in this rank's logits (clamped into them) and whether the token is among them."""
    columns = tokens if shard is None else tokens - shard.first
    return columns.clamp(0, width - 1)[:, None], ((columns >= 0) & (columns < width))


def _statistics(
    how: _Chunking,
    logits: torch.Tensor,
    own: bool,
    tokens: torch.Tensor,
    temperatures: torch.Tensor,
    scratch: _Scratch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(token), entropy, log Σ e^z) of one chunk, z = logits / T: with s = z - max z, log p(token) =
    s_token - log Σ e^s and the entropy log Σ e^s - Σ e^s·s / Σ e^s, each sum over every shard's columns.
    Two [rows, V] tensors at a time: s (in the logits where ``own``) and e^s (in place of s without the
    entropy)."""
    dtype = _float(logits)
    peak = logits.amax(-1, keepdim=True).to(dtype) / temperatures.to(dtype)  # T > 0: the max of z
    if how.shard is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=how.shard.group)
    shifted = _shifted(logits, own, temperatures, peak, scratch)
    column, inside = _columns(tokens, shifted.shape[-1], how.shard)
    picked = shifted.gather(-1, column)[:, 0].where(inside, 0.0)
    if how.entropy:
        exps = torch.exp(shifted, out=scratch.get("exps", len(shifted), shifted.shape[1], dtype, shifted.device))
        weighted = (exps[:, None, :] @ shifted[:, :, None]).view(-1)  # Σ e^s·s with no [n, V] product in memory
    else:
        exps, weighted = shifted.exp_(), torch.zeros_like(picked)
    sums = torch.stack([exps.sum(-1), picked, weighted])
    if how.shard is not None:
        dist.all_reduce(sums, group=how.shard.group)
    total, target, weighted = sums
    log_total = total.log()
    return target - log_total, log_total - weighted / total, peak[:, 0] + log_total


def _logit_gradient(
    how: _Chunking,
    logits: torch.Tensor,
    own: bool,
    per_row: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scratch: _Scratch,
    spare: torch.Tensor | None,
) -> torch.Tensor:
    """d(Σ grad · log p(token)) / d logits of one chunk: grad · (onehot(token) - p) / T, p = e^(z - normaliser)
    on this rank's columns, from ``per_row`` (tokens, temperatures, normaliser, grad); where ``_shifted`` puts z."""
    tokens, temperatures, normaliser, grad = per_row
    probabilities = _shifted(logits, own, temperatures, normaliser[:, None], scratch, spare).exp_()
    scale = grad[:, None].to(probabilities.dtype) / temperatures.to(probabilities.dtype)
    column, inside = _columns(tokens, probabilities.shape[-1], how.shard)
    return probabilities.mul_(-scale).scatter_add_(-1, column, scale.where(inside[:, None], 0.0))
