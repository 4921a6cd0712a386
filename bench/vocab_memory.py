"""Memory that scales with the vocabulary: each path that turns [tokens x vocabulary] logits into logprobs,
chunked (``algo.logprobs.token_logprobs``, which every path runs) against the whole log-softmax at once.

    .venv/bin/python bench/vocab_memory.py [--vocab 151936] [--hidden 256] [--tokens 2048] [--repeats 3] [--save]

Paths (N tokens, vocabulary V, hidden H, float32, one thread, T = 0.7 where a temperature applies):
- ``torch engine``: the policy's logprobs and entropies through the LM head (``engines.torch.outputs.
  target_logprobs``), forward and backward to the hidden states and the head; unchunked: ``log_softmax(head(hidden)
  / T)``, its targets' entries and the entropy from it.
- ``Megatron tp1``: the policy's output layer, ``engines.megatron.outputs.LogprobHead`` (the output layer's weight
  turned into logprobs a chunk of tokens at a time; a gloo group of one rank), on [N, 1, H] hidden states, forward
  and backward to the hidden states and the weight; unchunked: the output layer's [N, V] logits (``F.linear``, as
  Megatron's ``ColumnParallelLinear`` computes them) and the whole log-softmax on them; ``(no grad)``: the forward
  pass alone, as the reference and proximal logprobs run.
- ``SFT cross entropy``: ``train.sft.sft_loss`` on the torch engine's logprobs at T = 1, forward and backward;
  unchunked: ``F.cross_entropy(head(hidden), targets)`` (weighted alike), what a plain SFT step computes.
- ``server prompt scoring``: ``EmbeddedGenerator.score`` of one N-token prompt (distillation's teacher scores)
  on a one-layer Qwen2 of the same V and H; unchunked: the model's whole logits and their ``log_softmax``, the
  server's code before, run on the engine's thread as ``score`` is.

Memory: each (path, variant) runs in a fresh process (spawn) whose allocator takes blocks of 128 KiB and more
from the kernel and gives them back when freed (``MALLOC_MMAP_THRESHOLD_``), so its resident set follows what
is allocated. It builds its inputs and runs the path once (thread pools, kernel caches), then resets the
kernel's high-water mark of its resident set (writing 5 to ``/proc/self/clear_refs``), runs the path again
and reads the mark back (``VmHWM``): the peak resident memory of that call over what the process held before
it, torch's CPU allocations included (tracemalloc does not see them). Time: one more fresh process runs both
variants in turn, ``--repeats`` calls each after an untimed one; the median of each in CPU seconds of the
process (kernel time included: page faults are much of a new tensor's cost), which other processes on the
machine disturb less than wall time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from lora import in_child
from recording import machine, machine_and_versions, run_and_record, versions

from areal_hpc.algo import logprobs

PATHS = ("torch engine", "Megatron tp1", "Megatron tp1 (no grad)", "SFT cross entropy", "server prompt scoring")
VARIANTS = ("chunked", "unchunked")
TEMPERATURE = 0.7


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _whole_log_softmax(logits, tokens, temperature):
    """The unchunked computation: (log p_T(token), entropy) from the whole [N, V] float32 log-softmax."""
    import torch

    whole = torch.log_softmax(logits.float() / temperature, -1)
    with torch.no_grad():
        entropy = -(whole.exp() * whole).sum(-1)
    return whole.gather(-1, tokens[:, None])[:, 0], entropy


def _workload(path: str, vocab: int, hidden_size: int, tokens: int):
    """({variant: the call}, close): the path's calls, chunked and unchunked, on the same inputs (seeded)."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    weights = torch.rand(tokens, generator=generator)
    if path in ("torch engine", "SFT cross entropy"):
        from areal_hpc.engines.torch.outputs import target_logprobs
        from areal_hpc.train.sft import sft_loss

        head = torch.nn.Linear(hidden_size, vocab, bias=False)
        hidden = torch.randn(tokens, hidden_size, generator=generator, requires_grad=True)

        def trained(loss_of):
            def step():
                loss_of().backward()
                head.zero_grad(set_to_none=True)  # within the call: the next one starts without them
                hidden.grad = None

            return step

        if path == "SFT cross entropy":
            calls = {
                "chunked": lambda: sft_loss(
                    {"logprobs": target_logprobs(hidden, head, targets)[0]}, None, {"weights": weights}
                )[0],
                "unchunked": lambda: (weights * F.cross_entropy(head(hidden), targets, reduction="none")).sum(),
            }
        else:
            calls = {
                "chunked": lambda: (weights * target_logprobs(hidden, head, targets, TEMPERATURE)[0]).sum(),
                "unchunked": lambda: (weights * _whole_log_softmax(head(hidden), targets, TEMPERATURE)[0]).sum(),
            }
        return {variant: trained(loss_of) for variant, loss_of in calls.items()}, lambda: None
    if path.startswith("Megatron"):
        import torch.distributed as dist

        from areal_hpc.engines.megatron.outputs import LogprobHead, PassTargets

        folder = tempfile.mkdtemp(prefix="bench-vocab-")
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
        train = "no grad" not in path
        head = LogprobHead(torch.nn.Linear(hidden_size, vocab, bias=False).weight, dist.group.WORLD)
        head.requires_grad_(train)
        hidden = torch.randn(tokens, 1, hidden_size, generator=generator, requires_grad=train)
        goal = PassTargets(targets, torch.full((tokens, 1), TEMPERATURE))

        def on_hidden(logprobs_of):
            def step():
                with torch.set_grad_enabled(train):
                    logprobs = logprobs_of()
                    if train:
                        (weights * logprobs).sum().backward()
                head.weight.grad = hidden.grad = None

            return step

        return {
            "chunked": on_hidden(lambda: head(hidden, runtime_gather_output=goal)[0][:, 0, 0]),
            "unchunked": on_hidden(
                lambda: _whole_log_softmax(F.linear(hidden[:, 0], head.weight), targets, TEMPERATURE)[0]
            ),
        }, dist.destroy_process_group
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_hpc.rollout.embedded_engine import EmbeddedGenerator

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=tokens + 8,
    )
    torch.manual_seed(0)
    engine = EmbeddedGenerator(Qwen2ForCausalLM(config), slots=1)
    ids = targets.tolist()

    @torch.no_grad()
    def before():  # the server's scoring before it chunked: the model's whole logits
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, targets[1:, None])[:, 0].tolist()

    return {
        "chunked": lambda: engine.score(ids, 0).result(),
        "unchunked": lambda: engine.call(before).result(),
    }, engine.stop


def _peak_memory(path: str, variant: str, vocab: int, hidden_size: int, tokens: int) -> int:
    """In a fresh process on one thread: the call's peak resident memory over its start, in bytes."""
    import torch

    torch.set_num_threads(1)
    calls, close = _workload(path, vocab, hidden_size, tokens)
    calls[variant]()  # once unmeasured: thread pools, kernels' caches
    start = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from the resident set now
    calls[variant]()
    peak = _status_kib("VmHWM")
    close()
    return (peak - start) * 1024


def _cpu_seconds(path: str, vocab: int, hidden_size: int, tokens: int, repeats: int) -> dict[str, float]:
    """In a fresh process on one thread: each variant's CPU seconds per call, the median of ``repeats`` calls
    of each in turn after one untimed call of each."""
    import torch

    torch.set_num_threads(1)
    calls, close = _workload(path, vocab, hidden_size, tokens)
    times: dict[str, list[float]] = {variant: [] for variant in calls}
    for k in range(repeats + 1):
        for variant, call in calls.items():
            started = time.process_time()
            call()
            if k:
                times[variant].append(time.process_time() - started)
    close()
    return {variant: statistics.median(samples) for variant, samples in times.items()}


def run(args) -> dict:

    os.environ["OMP_NUM_THREADS"] = "1"
    # the children's allocator: blocks of 128 KiB and more straight from the kernel and back on free, so the
    # resident set follows what is allocated (glibc otherwise raises the threshold and keeps freed blocks)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    load, rows = [os.getloadavg()[0]], []
    for path in args.paths:
        seconds = in_child(_cpu_seconds, path, args.vocab, args.hidden, args.tokens, args.repeats)
        for variant in VARIANTS:
            peak = in_child(_peak_memory, path, variant, args.vocab, args.hidden, args.tokens)
            rows.append(
                {
                    "path": path,
                    "variant": variant,
                    "peak_over_start_bytes": peak,
                    "cpu_s_per_token": seconds[variant] / args.tokens,
                }
            )
            print(
                f"{path} {variant}: peak {peak / 2**20:.0f} MiB, {seconds[variant] / args.tokens * 1e6:.1f} CPU µs/token",
                file=sys.stderr,
                flush=True,
            )
    load.append(os.getloadavg()[0])
    return {
        "benchmark": "vocab_memory",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "versions": versions("torch", "transformers"),
        "vocab": args.vocab,
        "hidden": args.hidden,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "chunk_bytes": logprobs.LOGITS_CHUNK_BYTES,
        "rows": rows,
        "load_average_1min": load,
    }


def report(result: dict) -> str:
    mib = 2**20
    lines = [
        f"# Memory that scales with the vocabulary: chunked vs whole log-softmax ({result['date']})",
        "",
        machine_and_versions(result)
        + f" V = {result['vocab']:,}, H = {result['hidden']}, N = {result['tokens']:,} tokens, float32, one "
        f"thread, chunks of at most {result['chunk_bytes'] / mib:.0f} MiB of float32 logits. Peak: the call's "
        "resident high-water mark over its start, a fresh process per row. Time: CPU seconds per token (the "
        f"process's, kernel time included), median of {result['repeats']} calls of each variant in turn in one "
        "process. Other helpers' tests shared the 2 cores (1-minute load average at start and end: "
        f"{', '.join(f'{x:.1f}' for x in result['load_average_1min'])}).",
        "",
        "| path | variant | peak over start (MiB) | CPU µs/token |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['path']} | {r['variant']} | {r['peak_over_start_bytes'] / mib:,.0f} | "
            f"{r['cpu_s_per_token'] * 1e6:,.1f} |"
        )
    lines += ["", "Chunked / unchunked:", ""]
    by = {(r["path"], r["variant"]): r for r in result["rows"]}
    for path in dict.fromkeys(r["path"] for r in result["rows"]):
        chunked, whole = by[path, "chunked"], by[path, "unchunked"]
        memory = chunked["peak_over_start_bytes"] / whole["peak_over_start_bytes"]
        speed = chunked["cpu_s_per_token"] / whole["cpu_s_per_token"]
        lines.append(f"- {path}: peak memory **{memory:.3f}x** (1/{1 / memory:.1f}), time per token **{speed:.2f}x**")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each variant")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("vocab_memory", parser.parse_args(), run, report)
