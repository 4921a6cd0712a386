"""Segment attention for tree training (AReaL-DTA): a new segment's queries attend over the cached K/V
of its prefix (the path from the root) and, causally, over the segment's own K/V, so each tree segment
is forwarded once whatever number of leaves share it, and the prefix K/V gradients flow back to the
segment that produced them.

``segment_attention`` is a flash-attention style Triton kernel pair (online softmax forward keeping the
log-sum-exp, backward recomputing the probabilities; the prefix is read where it lies, never copied);
``segment_attention_reference`` is the same function in plain torch, float32 math, the one it is tested
against. Query i of the segment sits at position P + i: it sees every prefix key and segment keys <= i.
Grouped-query attention: query head h reads K/V head h // (H / H_kv), as ``repeat_interleave`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # queries per program
BLOCK_N = 64  # keys per inner step
LOG2E = 1.4426950408889634


def _check_shapes(q, k_prefix, v_prefix, k_seg, v_seg) -> None:
    """One line per mistake a caller can make: q [S, H, D], k/v_prefix [P, H_kv, D], k/v_seg [S, H_kv, D]."""
    if q.dim() != 3 or k_seg.dim() != 3 or k_prefix.dim() != 3:
        raise ValueError(
            f"segment_attention takes q [S, H, D] and k/v [L, H_kv, D]; got q {tuple(q.shape)}, "
            f"k_prefix {tuple(k_prefix.shape)}, k_seg {tuple(k_seg.shape)}"
        )
    if k_prefix.shape != v_prefix.shape or k_seg.shape != v_seg.shape:
        raise ValueError(
            f"keys and values differ in shape: k_prefix {tuple(k_prefix.shape)}, v_prefix "
            f"{tuple(v_prefix.shape)}, k_seg {tuple(k_seg.shape)}, v_seg {tuple(v_seg.shape)}"
        )
    (length, heads, dim), (_, kv_heads, kv_dim) = q.shape, k_seg.shape
    if len(k_seg) != length or k_prefix.shape[1:] != k_seg.shape[1:] or kv_dim != dim or heads % kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} needs k/v_seg [{length}, H_kv, {dim}] and k/v_prefix [P, H_kv, {dim}] "
            f"with H = {heads} a multiple of H_kv; got k_seg {tuple(k_seg.shape)}, "
            f"k_prefix {tuple(k_prefix.shape)}"
        )


def segment_attention_reference(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_seg: torch.Tensor,
    v_seg: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """[S, H, D]: softmax(q k^T · scale) v over [prefix ; segment] keys, segment keys causal, in float32
    (returned in q's dtype); differentiable by autograd."""
    _check_shapes(q, k_prefix, v_prefix, k_seg, v_seg)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k_seg.shape[1]
    keys = torch.cat([k_prefix, k_seg]).float().repeat_interleave(group, dim=1)
    values = torch.cat([v_prefix, v_seg]).float().repeat_interleave(group, dim=1)
    prefix, length = len(k_prefix), len(q)
    visible = torch.arange(prefix + length, device=q.device) <= prefix + torch.arange(length, device=q.device)[:, None]
    scores = torch.einsum("shd,khd->hsk", q.float(), keys) * scale
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hsk,khd->shd", weights, values).to(q.dtype)


@triton.jit
def _load_rows(ptr, rows, n_rows, n_heads, head, dims, D):
    """[len(rows), BLOCK_D] of a contiguous [n_rows, n_heads, D] tensor at one head (zeros outside)."""
    offsets = (rows[:, None].to(tl.int64) * n_heads + head) * D + dims[None, :]
    return tl.load(ptr + offsets, mask=(rows[:, None] < n_rows) & (dims[None, :] < D), other=0.0)


@triton.jit
def _key_block(
    q,
    query_positions,
    k_ptr,
    v_ptr,
    n0,
    key_start,
    n_keys,
    kv_head,
    n_kv_heads,
    scale_log2,
    D,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Keys n0.. of one K/V block list (key j at position key_start + j): their k and v rows, and q's
    scores against them (scaled to base 2), -inf where a key is after the query or past the list."""
    keys, dims = n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k = _load_rows(k_ptr, keys, n_keys, n_kv_heads, kv_head, dims, D)
    v = _load_rows(v_ptr, keys, n_keys, n_kv_heads, kv_head, dims, D)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    visible = (key_start + keys[None, :] <= query_positions[:, None]) & (keys[None, :] < n_keys)
    return k, v, tl.where(visible, scores, float("-inf"))


@triton.jit
def _forward_over_keys(
    acc,
    row_max,
    row_sum,
    q,
    query_positions,
    k_ptr,
    v_ptr,
    key_start,
    n_keys,
    stop,
    kv_head,
    n_kv_heads,
    scale_log2,
    D,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The online softmax over keys [0, stop) of one K/V block list whose key j sits at key_start + j."""
    for n0 in range(0, stop, BLOCK_N):
        _k, v, scores = _key_block(
            q,
            query_positions,
            k_ptr,
            v_ptr,
            n0,
            key_start,
            n_keys,
            kv_head,
            n_kv_heads,
            scale_log2,
            D,
            BLOCK_N,
            BLOCK_D,
            PRECISION,
        )
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        correction = tl.exp2(row_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * correction + tl.sum(p, 1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _segment_attention_forward(
    q_ptr,
    kp_ptr,
    vp_ptr,
    ks_ptr,
    vs_ptr,
    out_ptr,
    lse_ptr,
    P,
    S,
    H,
    H_KV,
    D,
    scale_log2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: BLOCK_M queries of one head. Writes out and lse (base-2, of the scaled scores)."""
    m0, head = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    kv_head = head // (H // H_KV)
    rows, dims = m0 + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    q = _load_rows(q_ptr, rows, S, H, head, dims, D)
    positions = P + rows
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: padding rows stay NaN-free
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, row_max, row_sum = _forward_over_keys(
        acc,
        row_max,
        row_sum,
        q,
        positions,
        kp_ptr,
        vp_ptr,
        0,
        P,
        P,
        kv_head,
        H_KV,
        scale_log2,
        D,
        BLOCK_N,
        BLOCK_D,
        PRECISION,
    )
    acc, row_max, row_sum = _forward_over_keys(
        acc,
        row_max,
        row_sum,
        q,
        positions,
        ks_ptr,
        vs_ptr,
        P,
        S,
        tl.minimum(S, m0 + BLOCK_M),
        kv_head,
        H_KV,
        scale_log2,
        D,
        BLOCK_N,
        BLOCK_D,
        PRECISION,
    )
    offsets = (rows[:, None].to(tl.int64) * H + head) * D + dims[None, :]
    tl.store(out_ptr + offsets, acc / row_sum[:, None], mask=(rows[:, None] < S) & (dims[None, :] < D))
    tl.store(lse_ptr + head * S + rows, row_max + tl.log2(row_sum), mask=rows < S)


@triton.jit
def _query_gradients_over_keys(
    dq,
    q,
    do,
    lse,
    delta,
    query_positions,
    k_ptr,
    v_ptr,
    key_start,
    n_keys,
    stop,
    kv_head,
    n_kv_heads,
    scale_log2,
    D,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dq (unscaled) += dS k over keys [0, stop) of one K/V block list whose key j sits at key_start + j."""
    for n0 in range(0, stop, BLOCK_N):
        k, v, scores = _key_block(
            q,
            query_positions,
            k_ptr,
            v_ptr,
            n0,
            key_start,
            n_keys,
            kv_head,
            n_kv_heads,
            scale_log2,
            D,
            BLOCK_N,
            BLOCK_D,
            PRECISION,
        )
        p = tl.exp2(scores - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _segment_attention_query_backward(
    q_ptr,
    kp_ptr,
    vp_ptr,
    ks_ptr,
    vs_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    P,
    S,
    H,
    H_KV,
    D,
    scale,
    scale_log2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: dq of BLOCK_M queries of one head."""
    m0, head = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    kv_head = head // (H // H_KV)
    rows, dims = m0 + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    q = _load_rows(q_ptr, rows, S, H, head, dims, D)
    do = _load_rows(do_ptr, rows, S, H, head, dims, D)
    lse = tl.load(lse_ptr + head * S + rows, mask=rows < S, other=0.0)
    delta = tl.load(delta_ptr + head * S + rows, mask=rows < S, other=0.0)
    positions = P + rows
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _query_gradients_over_keys(
        dq,
        q,
        do,
        lse,
        delta,
        positions,
        kp_ptr,
        vp_ptr,
        0,
        P,
        P,
        kv_head,
        H_KV,
        scale_log2,
        D,
        BLOCK_N,
        BLOCK_D,
        PRECISION,
    )
    dq = _query_gradients_over_keys(
        dq,
        q,
        do,
        lse,
        delta,
        positions,
        ks_ptr,
        vs_ptr,
        P,
        S,
        tl.minimum(S, m0 + BLOCK_M),
        kv_head,
        H_KV,
        scale_log2,
        D,
        BLOCK_N,
        BLOCK_D,
        PRECISION,
    )
    offsets = (rows[:, None].to(tl.int64) * H + head) * D + dims[None, :]
    tl.store(dq_ptr + offsets, dq * scale, mask=(rows[:, None] < S) & (dims[None, :] < D))


@triton.jit
def _segment_attention_key_backward(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    key_start,
    n_keys,
    P,
    S,
    H,
    H_KV,
    D,
    scale,
    scale_log2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: dk, dv of BLOCK_N keys of one K/V head (key j at position key_start + j), summed over
    the query heads that share it and over every segment query that sees it."""
    n0, kv_head = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    group = H // H_KV
    keys, dims = n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k = _load_rows(k_ptr, keys, n_keys, H_KV, kv_head, dims, D)
    v = _load_rows(v_ptr, keys, n_keys, H_KV, kv_head, dims, D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    first_query = tl.maximum(0, key_start + n0 - P) // BLOCK_M * BLOCK_M  # earlier queries see none of these keys
    for head in range(kv_head * group, (kv_head + 1) * group):
        for m0 in range(first_query, S, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            q = _load_rows(q_ptr, rows, S, H, head, dims, D)
            do = _load_rows(do_ptr, rows, S, H, head, dims, D)
            lse = tl.load(lse_ptr + head * S + rows, mask=rows < S, other=0.0)
            delta = tl.load(delta_ptr + head * S + rows, mask=rows < S, other=0.0)
            scores = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2  # [keys, queries]
            visible = (key_start + keys[:, None] <= P + rows[None, :]) & (rows[None, :] < S)
            p = tl.exp2(tl.where(visible, scores, float("-inf")) - lse[None, :])
            dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds = p * (dp - delta[None, :])
            dk += tl.dot(ds.to(q.dtype), q, input_precision=PRECISION)
    offsets = (keys[:, None].to(tl.int64) * H_KV + kv_head) * D + dims[None, :]
    mask = (keys[:, None] < n_keys) & (dims[None, :] < D)
    tl.store(dk_ptr + offsets, dk * scale, mask=mask)
    tl.store(dv_ptr + offsets, dv, mask=mask)


def _launch_options(q: torch.Tensor) -> dict:
    """Block sizes, and exact float32 dot products for float32 inputs (Triton would use TF32 on a GPU)."""
    return {
        "BLOCK_M": BLOCK_M,
        "BLOCK_N": BLOCK_N,
        "BLOCK_D": max(16, triton.next_power_of_2(q.shape[-1])),
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


class _SegmentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_seg, v_seg, scale):
        q, k_prefix, v_prefix, k_seg, v_seg = (x.contiguous() for x in (q, k_prefix, v_prefix, k_seg, v_seg))
        (length, heads, dim), prefix, kv_heads = q.shape, len(k_prefix), k_seg.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(heads, length, dtype=torch.float32, device=q.device)
        if length:
            _segment_attention_forward[(triton.cdiv(length, BLOCK_M), heads)](
                q,
                k_prefix,
                v_prefix,
                k_seg,
                v_seg,
                out,
                lse,
                prefix,
                length,
                heads,
                kv_heads,
                dim,
                scale * LOG2E,
                **_launch_options(q),
            )
        ctx.save_for_backward(q, k_prefix, v_prefix, k_seg, v_seg, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k_prefix, v_prefix, k_seg, v_seg, out, lse = ctx.saved_tensors
        (length, heads, dim), prefix, kv_heads = q.shape, len(k_prefix), k_seg.shape[1]
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1).T.contiguous()  # [H, S]: rowsum(dO ∘ O)
        grads = [torch.zeros_like(x) for x in (q, k_prefix, v_prefix, k_seg, v_seg)]
        if not length:
            return *grads, None
        options = _launch_options(q)
        scales = (ctx.scale, ctx.scale * LOG2E)
        _segment_attention_query_backward[(triton.cdiv(length, BLOCK_M), heads)](
            q,
            k_prefix,
            v_prefix,
            k_seg,
            v_seg,
            grad_out,
            lse,
            delta,
            grads[0],
            prefix,
            length,
            heads,
            kv_heads,
            dim,
            *scales,
            **options,
        )
        for key_start, k, v, dk, dv in ((0, k_prefix, v_prefix, *grads[1:3]), (prefix, k_seg, v_seg, *grads[3:])):
            if len(k):
                _segment_attention_key_backward[(triton.cdiv(len(k), BLOCK_N), kv_heads)](
                    q,
                    k,
                    v,
                    grad_out,
                    lse,
                    delta,
                    dk,
                    dv,
                    key_start,
                    len(k),
                    prefix,
                    length,
                    heads,
                    kv_heads,
                    dim,
                    *scales,
                    **options,
                )
        return *grads, None


def segment_attention(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_seg: torch.Tensor,
    v_seg: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """[S, H, D]: the segment's queries q [S, H, D] attending over the cached prefix k/v_prefix [P, H_kv, D]
    and, causally, the segment's own k/v_seg [S, H_kv, D]; scale defaults to 1/sqrt(D). Differentiable in
    all five tensors (Triton forward and backward); float32 accumulation, output in q's dtype."""
    _check_shapes(q, k_prefix, v_prefix, k_seg, v_seg)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _SegmentAttention.apply(q, k_prefix, v_prefix, k_seg, v_seg, scale)
