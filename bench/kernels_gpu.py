"""The Triton kernels of kernels/ timed on one GPU (sized for under 3 minutes on an H100/H200) against their
plain-torch references and torch's own way to do the same; ``--dry-run`` runs the same code on the CPU under
Triton's interpreter at toy sizes in float32 (tests/kernels/test_kernels.py does).

    PYTHONPATH=$PWD python3 bench/kernels_gpu.py [--dry-run] [--out DIR]

Needs torch and triton only (the chunked-torch row also imports ``areal_hpc.engines.torch.outputs``,
hence transformers; without it that row records its error). For each case, forward alone (no grad) and
forward+backward, median milliseconds of ``--repeats`` runs after a warm-up, peak memory over the inputs,
and the largest |difference| of the output (and of every input gradient) from the reference computed in
float32 on float32 copies of the same inputs:

- ``segment_attention`` (bf16; S segment tokens over P cached prefix tokens, H query / H_kv K/V heads, D):
  the Triton kernels; the reference (float32 einsum, dense [H, S, P+S] scores); torch's sdpa over the
  concatenated K/V with the lower-right causal bias (flash / memory-efficient kernels; K/V heads repeated
  for GQA); sdpa with a dense boolean mask.
- ``target_logprobs`` (bf16; N rows, Hd hidden, V vocabulary, per-row temperatures): the Triton kernels;
  the reference (full [N, V] logits); the trainer's chunked torch (``target_logprobs``, checkpointed
  chunks). The backward pass is that of sum(logprobs) (the trainer does not differentiate the entropy).

Each measurement is recorded as it finishes (a failure records its error; the others still run) in
``kernels_gpu.json`` and ``kernels_gpu.md`` under ``--out`` (default $OUT, else the current folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from recording import machine

ATTENTION_CASES = [
    dict(S=512, P=2048, H=12, H_kv=2, D=128),
    dict(S=2048, P=0, H=12, H_kv=2, D=128),
    dict(S=128, P=8192, H=32, H_kv=8, D=128),
]
LOGPROB_CASES = [dict(N=4096, Hd=1536, V=151936)]
DRY_ATTENTION_CASES = [dict(S=40, P=24, H=4, H_kv=2, D=32), dict(S=24, P=0, H=2, H_kv=1, D=16)]
DRY_LOGPROB_CASES = [dict(N=24, Hd=32, V=300)]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(run, repeats: int) -> float:
    """Median wall milliseconds of ``run()`` after one warm-up call (Triton compiles there)."""
    run()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def largest_gap(outputs, expected) -> float:
    return max(
        ((a.float() - b.float()).abs().max().item() for a, b in zip(outputs, expected) if a.numel()), default=0.0
    )


def measure(function, inputs: list[torch.Tensor], loss, expected, repeats: int) -> dict:
    """Forward and forward+backward times of ``function(*inputs)``, the peak memory of each beyond the
    inputs, and the largest gap of (outputs, input gradients) from ``expected``."""

    def forward():
        with torch.no_grad():
            function(*inputs)

    def forward_backward():
        for x in inputs:
            x.grad = None
        loss(function(*inputs)).backward()

    row = {}
    for name, run in (("forward", forward), ("forward_backward", forward_backward)):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        row[f"{name}_ms"] = median_ms(run, repeats)
        if torch.cuda.is_available():
            row[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - baseline) / 2**20
    outputs = function(*inputs)
    row["max_abs_error"] = largest_gap(outputs if isinstance(outputs, tuple) else (outputs,), expected[0])
    row["max_abs_grad_error"] = largest_gap([x.grad for x in inputs], expected[1])
    return row


def reference_results(reference, inputs: list[torch.Tensor], loss) -> tuple[list, list]:
    """(outputs, input gradients) of the reference in float32 on float32 copies of ``inputs``."""
    copies = [x.detach().float().requires_grad_() for x in inputs]
    outputs = reference(*copies)
    loss(outputs).backward()
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [o.detach() for o in outputs], [x.grad for x in copies]


def sdpa_lower_right(q, k_prefix, v_prefix, k_seg, v_seg):
    """torch's sdpa over [prefix ; segment] K/V, query i at position P + i (the lower-right causal bias)."""
    from torch.nn.attention.bias import causal_lower_right

    group = q.shape[1] // k_seg.shape[1]
    keys, values = (
        torch.cat(pair).repeat_interleave(group, dim=1).transpose(0, 1)[None]
        for pair in ((k_prefix, k_seg), (v_prefix, v_seg))
    )
    bias = causal_lower_right(len(q), keys.shape[2])
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=bias)[0].transpose(0, 1)


def sdpa_dense_mask(q, k_prefix, v_prefix, k_seg, v_seg):
    """torch's sdpa over [prefix ; segment] K/V with a dense boolean [S, P + S] mask, GQA by sdpa."""
    prefix, length = len(k_prefix), len(q)
    mask = torch.arange(prefix + length, device=q.device) <= prefix + torch.arange(length, device=q.device)[:, None]
    keys, values = (torch.cat(pair).transpose(0, 1)[None] for pair in ((k_prefix, k_seg), (v_prefix, v_seg)))
    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != q.shape[1]
    )[0].transpose(0, 1)


def attention_rows(case: dict, device, dtype, repeats: int):
    from areal_hpc._kernels.segment_attention import segment_attention, segment_attention_reference

    torch.manual_seed(0)
    s, p, h, h_kv, d = case["S"], case["P"], case["H"], case["H_kv"], case["D"]
    shapes = [(s, h, d), (p, h_kv, d), (p, h_kv, d), (s, h_kv, d), (s, h_kv, d)]
    inputs = [torch.randn(shape, device=device, dtype=dtype).requires_grad_() for shape in shapes]
    grad = torch.randn(s, h, d, device=device, dtype=dtype)

    def loss(out):
        return (out.float() * grad.float()).sum()

    expected = reference_results(segment_attention_reference, inputs, loss)
    for name, function in (
        ("triton", segment_attention),
        ("reference", segment_attention_reference),
        ("sdpa_lower_right_causal", sdpa_lower_right),
        ("sdpa_dense_mask", sdpa_dense_mask),
    ):
        yield name, lambda function=function: measure(function, inputs, loss, expected, repeats)


def logprob_rows(case: dict, device, dtype, repeats: int):
    from areal_hpc._kernels.target_logprobs import target_logprobs_entropy, target_logprobs_entropy_reference

    torch.manual_seed(0)
    n, hd, v = case["N"], case["Hd"], case["V"]
    hidden = torch.randn(n, hd, device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, hd, device=device, dtype=dtype) * hd**-0.5).requires_grad_()
    tokens = torch.randint(0, v, (n,), device=device)
    temperatures = torch.rand(n, device=device) + 0.5

    def loss(outputs):
        return outputs[0].sum()

    def trainer_chunked(hidden, weight):
        from areal_hpc.engines.torch.outputs import target_logprobs

        return target_logprobs(hidden, SimpleNamespace(weight=weight, bias=None), tokens, temperatures[:, None])

    def bound(function):
        return lambda hidden, weight: function(hidden, weight, tokens, temperatures)

    expected = reference_results(bound(target_logprobs_entropy_reference), [hidden, weight], loss)
    for name, function in (
        ("triton", bound(target_logprobs_entropy)),
        ("reference", bound(target_logprobs_entropy_reference)),
        ("torch_chunked", trainer_chunked),
    ):
        yield name, lambda function=function: measure(function, [hidden, weight], loss, expected, repeats)


def markdown(record: dict) -> str:
    lines = [
        f"# Triton kernels ({record['device']}, torch {record['torch']}, triton {record['triton']}"
        f"{', dry run' if record['dry_run'] else ''}), {record['date']}",
        "",
        f"Machine: {record['machine']}.",
        "",
        "| kernel | case | implementation | forward ms | fwd+bwd ms | fwd+bwd peak MiB | max abs error | "
        "max abs grad error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        case = " ".join(f"{k}={v}" for k, v in row["case"].items())
        if "error" in row:
            lines.append(f"| {row['kernel']} | {case} | {row['implementation']} | error: {row['error']} | | | | |")
            continue
        peak = row.get("forward_backward_peak_mib")
        lines.append(
            f"| {row['kernel']} | {case} | {row['implementation']} | {row['forward_ms']:.3f} | "
            f"{row['forward_backward_ms']:.3f} | {'' if peak is None else f'{peak:.0f}'} | "
            f"{row['max_abs_error']:.2e} | {row['max_abs_grad_error']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, toy sizes, float32")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (10; 1 dry)")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: before their import
    elif not torch.cuda.is_available():
        sys.exit("bench/kernels_gpu.py needs a CUDA device (or --dry-run)")
    import triton

    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    repeats = args.repeats or (1 if args.dry_run else 10)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "date": date.today().isoformat(),
        "machine": machine(),
        "device": "cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "dry_run": args.dry_run,
        "repeats": repeats,
        "rows": [],
    }
    cases = [
        ("segment_attention", attention_rows, DRY_ATTENTION_CASES if args.dry_run else ATTENTION_CASES),
        ("target_logprobs", logprob_rows, DRY_LOGPROB_CASES if args.dry_run else LOGPROB_CASES),
    ]

    def add(row: dict, run=None) -> None:
        if run is not None:
            try:
                row.update(run())
            except Exception as error:  # noqa: BLE001 - recorded in the row; the other rows still run
                row["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                traceback.print_exc()
        record["rows"].append(row)
        print(json.dumps(row), flush=True)
        (args.out / "kernels_gpu.json").write_text(json.dumps(record, indent=1))
        (args.out / "kernels_gpu.md").write_text(markdown(record))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    for kernel, rows, sizes in cases:
        for case in sizes:
            try:
                for implementation, run in rows(case, device, dtype, repeats):
                    add({"kernel": kernel, "case": case, "implementation": implementation}, run)
            except Exception as error:  # noqa: BLE001 - the inputs or the float32 reference of this case failed
                traceback.print_exc()
                add(
                    {
                        "kernel": kernel,
                        "case": case,
                        "implementation": "setup",
                        "error": f"{type(error).__name__}: {error}".splitlines()[0][:300],
                    }
                )
    print(markdown(record), flush=True)


if __name__ == "__main__":
    main()
