"""One accelerator check of the trainer and the rollout engine, sized to run in under 8 minutes on one H100/H200
with nothing downloaded there; ``--dry-run`` runs the same code paths on the CPU at toy sizes (CI does).

    python3 bench/gpu_check.py [--dry-run] [--out DIR] [--model NAME] [--only SECTION ...] [--save]

Sections, each timed on its own and recorded as it finishes (a section that fails records its error and
the others still run), on a model of the planner's catalog (``--model``; by default R1-Distill-Qwen-1.5B's
config.json: a Qwen2.5-1.5B, 28 layers, hidden 1536, GQA 12/2 heads, vocabulary 151,936) with random
weights:

- ``torch_engine`` / ``megatron_engine``: PPO steps (``PPOActor``'s loss through the engine's
  ``train_step``: forward, loss, backward, clip, Adam) on packed micro-batches of sequences of 20-400
  tokens, bfloat16 compute (the torch engine autocasts over fp32 master weights; Megatron runs its own
  mixed precision where this build has it, float32 otherwise: the row says which). Tokens/s and MFU:
  model FLOPs per step = 6 x (matmul parameters: every linear layer and the LM head, not the input
  embedding) x tokens + 6 x layers x hidden x sum of squared sequence lengths (causal attention,
  forward and backward), over the device's dense bf16 peak from ``sched/hardware.py``.
- ``logprobs``: the trainer's per-token logprobs of one batch, accelerator bfloat16 autocast and
  accelerator float32 against CPU float32 (the reference), mean and max |difference| over target
  tokens, against the stated tolerance ``LOGPROB_TOLERANCE``.
- ``decode``: the embedded rollout engine's decode tokens/s at batch 1, 32 and 128 (64-token prompts,
  128 new tokens each, sampling at temperature 1, end of sequence ignored) vs Hugging Face
  ``generate()`` on the same bfloat16 model and the same work.
- ``attention``: one forward+backward of a packed micro-batch through the attention the trainer picks
  on the device (``models/varlen.py``: torch's varlen flash kernel on a GPU in bf16), per-sequence sdpa
  (the CPU's) and the model's own sdpa over the dense block-diagonal mask; each one's largest logprob
  gap to per-sequence sdpa in float32.
- ``weight_push``: the new weights from the trainer (``rollout_weights`` buckets) into a rollout engine:
  in one process (bucket by bucket, as ``/update_weights_from_distributed`` loads them) and through a
  Hugging Face folder on disk (``rl.weight_sync=disk``). The NCCL push needs a second device (NCCL
  refuses two ranks on one GPU): on one GPU it is not measured.
- ``families``: each other family of the catalog (Qwen3, Llama 3, Gemma 3: one model each, real shapes,
  random weights) through both engines' PPO steps, and the embedded engine's greedy tokens against
  ``generate()``'s in float32.

The JSON (``gpu_check.json``) and the table (``gpu_check.md``) go to ``--out``, and so does every file the
check writes while it runs (models, run folders: removed at the end); nothing lands in the working
directory. ``--save`` also records them in bench/results/ under the device's name.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from datetime import date
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, machine_and_versions, save
from trainer_step import dense_policy_outputs, mixed_length_batch

from areal_hpc.config import load_config
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.engines.torch import outputs
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import PolicyOutputs, packed_policy_outputs
from areal_hpc.models.hf import load_model
from areal_hpc.models.varlen import VARLEN_SDPA, packed_attention_inputs, padded_groups
from areal_hpc.resolve import Host, resolve
from areal_hpc.rollout.embedded_engine import EmbeddedGenerator, SamplingParams
from areal_hpc.sched.catalog import MODELS, model_names
from areal_hpc.sched.hardware import CATALOGUE
from areal_hpc.train.build import build_actor

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "r1-distill-qwen-1.5b"
# One model of each other family the catalog holds, for the ``families`` section.
FAMILY_MODELS = {"qwen3": "qwen3-1.7b", "llama": "llama-3.2-1b", "gemma3_text": "gemma-3-1b"}
TOY = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)
# Gemma 3 on a dry run: one sliding layer (window 8, shorter than the dry run's sequences), one global one.
TOY_FAMILY = {"gemma3_text": dict(sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=16)}
LOGPROB_TOLERANCE = {"bfloat16": (0.05, 1.0), "float32": (2e-3, 5e-2)}  # (mean, max) |Δ logprob| in nats


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each section's work is: the real check or the CPU dry run."""

    tokens_per_step: int
    tokens_per_mb: int
    steps: int
    decode_batches: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int
    logprob_sequences: int
    logprob_length: int
    attention_tokens: int


FULL = Sizes(16384, 8192, 3, (1, 32, 128), 64, 128, 4, 256, 8192)
DRY = Sizes(1024, 512, 2, (1, 4, 8), 16, 8, 2, 32, 512)


def catalogue_peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of the catalogue's device whose name ``device_name`` holds (the longest such name:
    "NVIDIA H200" is an H200, not an H20); None when none does."""
    known = [a for key, a in CATALOGUE.items() if key.lower() in device_name.lower()]
    return max(known, key=lambda a: len(a.name)).tflops if known else None


def device_peak_tflops(device: torch.device) -> tuple[str, float | None]:
    """The device's name and its dense bf16 peak (None off the catalogue, and for the CPU)."""
    if device.type != "cuda":
        return platform.processor() or "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, catalogue_peak_tflops(name)


def make_model(name: str, folder: Path, device: torch.device, dry_run: bool) -> dict:
    """Catalogued model ``name`` (a toy of its family on a dry run) with random weights, saved in bf16 to
    ``folder`` with the tiny tokenizer (the engines save it with the weights; no token is ever decoded to text)."""
    from areal_hpc.models.tokenizer import build_tokenizer

    shape = json.loads((MODELS / name / "config.json").read_text())
    family = shape.pop("model_type")
    shape = {k: v for k, v in shape.items() if k not in ("architectures", "torch_dtype")}
    if dry_run:
        shape.update(TOY, **TOY_FAMILY.get(family, {}))
    config = transformers.AutoConfig.for_model(family, **{**shape, "max_position_embeddings": 4096})
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    build_tokenizer(["0 1 2 3 4 5 6 7 8 9 + = ?"]).save_pretrained(folder)
    embedding = model.get_input_embeddings().weight.numel()
    return {
        "name": name,
        "family": family,
        "parameters": sum(p.numel() for p in model.parameters()),
        "matmul_parameters": sum(p.numel() for p in model.parameters())
        - (0 if config.tie_word_embeddings else embedding)  # a tied table is the LM head's matmul too
        - sum(p.numel() for n, p in model.named_parameters() if "norm" in n),
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "attention_width": config.num_attention_heads
        * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
        "sliding_layers": sum(kind == "sliding_attention" for kind in getattr(config, "layer_types", None) or []),
        "sliding_window": getattr(config, "sliding_window", None) or 0,
        "vocab": config.vocab_size,
    }


def model_flops(batch: SequenceBatch, shape: dict) -> float:
    """Training FLOPs of one pass over ``batch`` (see the module docstring); a sliding-window layer's
    attention covers at most its window of keys per query."""
    lengths = [len(s) for s in batch.sequences]
    window, sliding = shape["sliding_window"], shape["sliding_layers"]

    def attended(n: int, layer_window: int) -> float:  # twice the (query, key) pairs a causal layer scores
        return n * n if not layer_window or n <= layer_window else 2 * n * layer_window - layer_window**2

    attention = sum((shape["layers"] - sliding) * attended(n, 0) + sliding * attended(n, window) for n in lengths)
    return 6.0 * shape["matmul_parameters"] * sum(lengths) + 6.0 * shape["attention_width"] * attention


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class Check:
    """The run's shared state: model folder, device, sizes, and the results recorded so far."""

    def __init__(self, args):
        self.dry_run, self.out, self.overrides = args.dry_run, Path(args.out), list(args.set or [])
        self.sizes = DRY if args.dry_run else FULL
        self.device = torch.device("cpu") if args.dry_run else torch.device("cuda")
        self.out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="scratch-", dir=self.out))
        self.models: dict[str, tuple[Path, dict]] = {}
        self.device_name, self.peak_tflops = device_peak_tflops(self.device)
        self.result = {
            "benchmark": "gpu_check",
            "date": date.today().isoformat(),
            "machine": machine(),
            "dry_run": self.dry_run,
            "device": self.device_name,
            "peak_bf16_tflops": self.peak_tflops,
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "transformers": transformers.__version__,
                "megatron-core": _version("megatron-core"),
            },
            "sizes": dataclasses.asdict(self.sizes),
            "overrides": self.overrides,
            "sections": {},
        }
        self.use_model(args.model)
        self.result["model"] = self.shape

    def use_model(self, name: str) -> None:
        """Make catalogued model ``name`` the one the sections use (built on first use)."""
        if name not in self.models:
            folder = self.tmp / name
            self.models[name] = folder, make_model(name, folder, self.device, self.dry_run)
        self.model_dir, self.shape = self.models[name]

    def config(self, *overrides: str):
        loaded = load_config(
            str(ROOT / "configs/quickstart.yaml"),
            [
                f"model.path={self.model_dir}",
                f"cluster.fileroot={self.tmp}",
                f"actor.max_tokens_per_mb={self.sizes.tokens_per_mb}",
                "model.compute_dtype=bfloat16",
                "actor.tree_training=off",
                *overrides,
                *self.overrides,
            ],
        )
        return resolve(loaded, Host.probe()).cfg

    def training_batch(self, vocab: int) -> SequenceBatch:
        return mixed_length_batch(self.sizes.tokens_per_step, vocab, np.random.default_rng(0))

    def record(self, name: str, section: dict) -> None:
        self.result["sections"][name] = section
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=1) + "\n")
        (self.out / "gpu_check.md").write_text(report(self.result) + "\n")


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    with contextlib.suppress(PackageNotFoundError):
        return version(package)
    return None


def ppo_steps(check: Check, engine_name: str) -> dict:
    """Median time of ``sizes.steps`` PPO steps (after one untimed) of ``actor.engine=engine_name``."""
    cfg = check.config(f"actor.engine={engine_name}")
    try:
        actor = build_actor(cfg, None)[0]
        compute = "bfloat16"
    except Exception as refused:  # an engine that does not build bfloat16 yet: its float32 row, and why
        if "compute_dtype" not in str(refused):
            raise
        actor, compute = (
            build_actor(check.config(f"actor.engine={engine_name}", "model.compute_dtype=float32"), None)[0],
            f"float32 ({refused})",
        )
    engine = actor.actor
    batch = check.training_batch(check.shape["vocab"])
    reset_peak(engine.device)
    times, stats = [], {}
    for step in range(check.sizes.steps + 1):
        synchronize(engine.device)
        started = time.perf_counter()
        stats = engine.train_step(batch, actor._policy_loss)
        synchronize(engine.device)
        if step:
            times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    flops = model_flops(batch, check.shape) / seconds
    return {
        "compute": compute,
        "tokens": batch.n_tokens,
        "sequences": len(batch),
        "microbatches": stats.get("microbatches"),
        "s_per_step": seconds,
        "tokens_per_s": batch.n_tokens / seconds,
        "tflops": flops / 1e12,
        "mfu": flops / (check.peak_tflops * 1e12) if check.peak_tflops else None,
        "peak_memory_gib": peak_memory_gib(engine.device),
        "loss": stats.get("loss"),
        "grad_norm": stats.get("grad_norm"),
    }


def torch_engine(check: Check) -> dict:
    return ppo_steps(check, "torch")


def megatron_engine(check: Check) -> dict:
    return ppo_steps(check, "megatron")


def logprobs(check: Check) -> dict:
    """Per-token logprobs on the device (bf16 autocast, float32) against CPU float32."""
    rng = np.random.default_rng(1)
    n, length = check.sizes.logprob_sequences, check.sizes.logprob_length
    sequences = [rng.integers(0, check.shape["vocab"], length).tolist() for _ in range(n)]
    batch = SequenceBatch(sequences, [[0] * (length // 4) + [1] * (length - length // 4)] * n)

    def per_token(device: torch.device, compute: str) -> torch.Tensor:
        engine = TorchTrainEngine(
            load_model(check.model_dir, "float32", device=device),
            PolicyOutputs(1.0),
            max_tokens_per_mb=n * length,
            compute_dtype=compute,
        )
        return torch.cat(engine.forward(batch)["logprobs"])

    reference = per_token(torch.device("cpu"), "float32")
    targets = reference != 0
    rows = {}
    for compute in ("bfloat16", "float32"):
        gap = (per_token(check.device, compute) - reference)[targets].abs()
        mean_ok, max_ok = LOGPROB_TOLERANCE[compute]
        rows[compute] = {
            "mean_abs": float(gap.mean()),
            "max_abs": float(gap.max()),
            "tolerance_mean": mean_ok,
            "tolerance_max": max_ok,
            "within": bool(gap.mean() <= mean_ok and gap.max() <= max_ok),
        }
    return {"targets": int(targets.sum()), "reference_mean_logprob": float(reference[targets].mean()), **rows}


def decode(check: Check) -> dict:
    """Embedded engine vs ``generate()``: decode tokens/s at each batch size, same bf16 model, same work."""
    model = load_model(check.model_dir, "bfloat16", device=check.device)
    s = check.sizes
    engine = EmbeddedGenerator(
        model, slots=max(s.decode_batches), context_length=s.prompt_tokens + s.new_tokens, eos_token_ids=[]
    )
    params = SamplingParams(max_new_tokens=s.new_tokens, ignore_eos=True)
    rng = np.random.default_rng(2)

    async def ours(prompts: list[list[int]]) -> int:
        results = await asyncio.gather(*(engine.generate(f"r{i}", p, params) for i, p in enumerate(prompts)))
        return sum(len(r.output_ids) for r in results)

    def theirs(prompts: list[list[int]]) -> int:
        ids = torch.tensor(prompts, device=check.device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            top_k=0,
            top_p=1.0,
            max_new_tokens=s.new_tokens,
            min_new_tokens=s.new_tokens,
            pad_token_id=0,
        )
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    def timed(run) -> tuple[int, float]:
        synchronize(check.device)
        started = time.perf_counter()
        tokens = run()
        synchronize(check.device)
        return tokens, time.perf_counter() - started

    rows = []
    try:
        for batch in s.decode_batches:
            prompts = [rng.integers(0, check.shape["vocab"], s.prompt_tokens).tolist() for _ in range(batch)]
            asyncio.run(ours(prompts[:1]))  # warm-up: kernels, allocator
            theirs(prompts[:1])
            tokens, seconds = timed(lambda: asyncio.run(ours(prompts)))  # noqa: B023 - called within this iteration
            their_tokens, their_seconds = timed(lambda: theirs(prompts))  # noqa: B023 - called within this iteration
            rows.append(
                {
                    "batch": batch,
                    "tokens": tokens,
                    "tokens_per_s": tokens / seconds,
                    "generate_tokens_per_s": their_tokens / their_seconds,
                    "ratio": (tokens / seconds) / (their_tokens / their_seconds),
                }
            )
    finally:
        engine.stop()
    return {"rows": rows}


def per_sequence_sdpa_outputs(model: torch.nn.Module, batch, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """``packed_policy_outputs`` with per-sequence sdpa forced (the CPU's path), whatever the device."""

    def sdpa_inputs(model, cu_seqlens):
        return VARLEN_SDPA, {"padded_groups": padded_groups(cu_seqlens)}

    with mock.patch.object(outputs, "packed_attention_inputs", sdpa_inputs):
        return packed_policy_outputs(model, batch, temperature)


def attention(check: Check) -> dict:
    """Forward+backward of one packed micro-batch in bf16 autocast: the trainer's attention on this device,
    per-sequence sdpa and dense-mask sdpa; each one's logprobs against per-sequence sdpa in float32."""
    model = load_model(check.model_dir, "float32", device=check.device)
    batch = mixed_length_batch(check.sizes.attention_tokens, check.shape["vocab"], np.random.default_rng(3))
    packed = batch.packed()[0].to(check.device)
    with torch.no_grad():
        reference = per_sequence_sdpa_outputs(model, packed)["logprobs"].float()
    with torch.autocast(check.device.type, dtype=torch.bfloat16):
        trainer_path = packed_attention_inputs(model, packed.cu_seqlens)[0]
    rows = {}
    for name, forward in (
        (f"trainer ({trainer_path})", packed_policy_outputs),
        ("per-sequence sdpa", per_sequence_sdpa_outputs),
        ("dense-mask sdpa", dense_policy_outputs),
    ):
        times = []
        for repeat in range(3):
            model.zero_grad(set_to_none=True)
            synchronize(check.device)
            started = time.perf_counter()
            with torch.autocast(check.device.type, dtype=torch.bfloat16):
                out = forward(model, packed)["logprobs"]
            out.sum().backward()
            synchronize(check.device)
            if repeat:
                times.append(time.perf_counter() - started)
        rows[name] = {
            "tokens_per_s": packed.input_ids.shape[1] / statistics.median(times),
            "max_abs_vs_float32": float((out.detach().float() - reference).abs().max()),
        }
    return {"tokens": packed.input_ids.shape[1], "sequences": len(batch), "rows": rows}


def weight_push(check: Check) -> dict:
    """Trainer weights into a rollout engine: in process, bucket by bucket; and through a folder on disk."""
    cfg = check.config()
    engine = build_actor(cfg, None)[0].actor
    server = EmbeddedGenerator(
        load_model(check.model_dir, "bfloat16", device=check.device), slots=4, context_length=256, eos_token_ids=[]
    )
    bucket_bytes = cfg.rl.weight_sync_bucket_mb << 20
    try:
        synchronize(check.device)
        started = time.perf_counter()
        pushed = 0
        for bucket in engine.rollout_weights(bucket_bytes):
            server.update_weights(dict(bucket), None, complete=False).result()
            pushed += sum(t.numel() * t.element_size() for _, t in bucket)
        synchronize(check.device)
        in_process = time.perf_counter() - started
        folder = check.tmp / "weights"
        started = time.perf_counter()
        engine.save(folder, optimizer=False)
        saved = time.perf_counter() - started
        server.update_weights_from_disk(folder).result()
        synchronize(check.device)
        loaded = time.perf_counter() - started - saved
    finally:
        server.stop()
    return {
        "bytes": pushed,
        "bucket_mb": cfg.rl.weight_sync_bucket_mb,
        "in_process_s": in_process,
        "in_process_gb_per_s": pushed / in_process / 1e9,
        "disk_save_s": saved,
        "disk_load_s": loaded,
        "nccl": "not measured: one device (NCCL refuses two ranks on one GPU)",
    }


def greedy_agreement(check: Check) -> dict:
    """The embedded engine's greedy tokens against ``generate()``'s, both in float32 on the device: the
    share of sequences whose tokens are all equal (random weights leave near-ties only by chance)."""
    model = load_model(check.model_dir, "float32", device=check.device)
    s, rng = check.sizes, np.random.default_rng(4)
    prompts = [rng.integers(0, check.shape["vocab"], s.prompt_tokens).tolist() for _ in range(4)]
    engine = EmbeddedGenerator(model, slots=4, context_length=s.prompt_tokens + s.new_tokens, eos_token_ids=[])
    params = SamplingParams(max_new_tokens=s.new_tokens, temperature=0.0, ignore_eos=True)

    async def ours() -> list[list[int]]:
        results = await asyncio.gather(*(engine.generate(f"g{i}", p, params) for i, p in enumerate(prompts)))
        return [list(r.output_ids) for r in results]

    try:
        tokens = asyncio.run(ours())
    finally:
        engine.stop()
    ids = torch.tensor(prompts, device=check.device)
    theirs = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=s.new_tokens,
        min_new_tokens=s.new_tokens,
        pad_token_id=0,
    )[:, ids.shape[1] :].tolist()
    return {"sequences": len(prompts), "equal": sum(a == b for a, b in zip(tokens, theirs, strict=True))}


def attempt(work) -> dict:
    """``work()``'s record, or its error and traceback: one failure does not stop the check."""
    try:
        return work()
    except Exception as failure:  # noqa: BLE001 - recorded; the rest still runs
        return {"error": f"{type(failure).__name__}: {failure}", "traceback": traceback.format_exc(limit=6)}


def families(check: Check) -> dict:
    """Each other family's catalogued model: both engines' PPO steps and greedy decoding against ``generate()``."""
    primary, rows = check.shape["name"], {}
    try:
        for family, name in FAMILY_MODELS.items():
            if name == primary:
                continue
            check.use_model(name)
            rows[family] = {
                "model": name,
                "parameters": check.shape["parameters"],
                "torch_engine": attempt(lambda: ppo_steps(check, "torch")),
                "megatron_engine": attempt(lambda: ppo_steps(check, "megatron")),
                "greedy": attempt(lambda: greedy_agreement(check)),
            }
            gc.collect()
    finally:
        check.use_model(primary)
    return {"rows": rows}


SECTIONS = {
    "torch_engine": torch_engine,
    "megatron_engine": megatron_engine,
    "logprobs": logprobs,
    "decode": decode,
    "attention": attention,
    "weight_push": weight_push,
    "families": families,
}


def run(args) -> dict:
    check = Check(args)
    try:
        for name in args.only or SECTIONS:
            started = time.perf_counter()
            print(f"[gpu_check] {name} ...", flush=True)
            section = attempt(lambda: SECTIONS[name](check))  # noqa: B023 - called within this iteration
            section["seconds"] = time.perf_counter() - started
            check.record(name, section)
            print(
                f"[gpu_check] {name}: {'error: ' + section['error'] if 'error' in section else 'ok'} "
                f"({section['seconds']:.1f} s)",
                flush=True,
            )
            gc.collect()  # the section's engines and models, before the next one allocates
            if check.device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(check.tmp, ignore_errors=True)
    return check.result


def _fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def report(r: dict) -> str:
    s, m = r["sections"], r["model"]
    lines = [
        f"# GPU check{' (dry run, CPU, toy sizes)' if r['dry_run'] else ''}: {r['device']} ({r['date']})",
        "",
        machine_and_versions(r) + (f" Overrides: {' '.join(r['overrides'])}." if r.get("overrides") else ""),
        f"Model: {m['name']} ({m['family']}), {m['parameters'] / 1e6:,.1f}M parameters ({m['layers']} layers, hidden "
        f"{m['hidden']}, vocabulary {m['vocab']}), random weights. Peak dense bf16: "
        f"{_fmt(r['peak_bf16_tflops'])} TFLOP/s.",
        "",
    ]
    for name in ("torch_engine", "megatron_engine"):
        if name in s:
            lines.append(_engine_row(name, s[name]))
    if "logprobs" in s:
        lp = s["logprobs"]
        lines += ["", "## Logprobs against CPU float32", ""]
        lines += (
            [f"Error: {lp['error']}"]
            if "error" in lp
            else ["| device compute | mean abs | max abs | tolerance (mean, max) | within |", "|---|---|---|---|---|"]
            + [
                f"| {c} | {lp[c]['mean_abs']:.2e} | {lp[c]['max_abs']:.2e} | {lp[c]['tolerance_mean']}, "
                f"{lp[c]['tolerance_max']} | {lp[c]['within']} |"
                for c in ("bfloat16", "float32")
            ]
            + ["", f"{lp['targets']} target tokens; mean reference logprob {lp['reference_mean_logprob']:.2f}."]
        )
    if "decode" in s:
        lines += ["", "## Decode: embedded engine vs generate()", ""]
        lines += (
            [f"Error: {s['decode']['error']}"]
            if "error" in s["decode"]
            else ["| batch | ours tokens/s | generate() tokens/s | ratio |", "|---|---|---|---|"]
            + [
                f"| {row['batch']} | {row['tokens_per_s']:.0f} | {row['generate_tokens_per_s']:.0f} | "
                f"**{row['ratio']:.2f}x** |"
                for row in s["decode"]["rows"]
            ]
        )
    if "attention" in s:
        a = s["attention"]
        lines += ["", "## Packed attention: one micro-batch, forward+backward, bf16 autocast", ""]
        lines += (
            [f"Error: {a['error']}"]
            if "error" in a
            else [
                f"{a['tokens']} tokens in {a['sequences']} sequences.",
                "",
                "| attention | tokens/s | vs dense mask | max abs logprob gap to float32 |",
                "|---|---|---|---|",
            ]
            + [
                f"| {name} | {row['tokens_per_s']:.0f} | **{row['tokens_per_s'] / a['rows']['dense-mask sdpa']['tokens_per_s']:.2f}x**"
                f" | {row['max_abs_vs_float32']:.2e} |"
                for name, row in a["rows"].items()
            ]
        )
    if "weight_push" in s:
        w = s["weight_push"]
        lines += ["", "## Weight push", ""]
        lines += (
            [f"Error: {w['error']}"]
            if "error" in w
            else [
                f"{w['bytes'] / 1e9:.2f} GB in {w['bucket_mb']} MB buckets: in process {w['in_process_s']:.2f} s "
                f"({w['in_process_gb_per_s']:.1f} GB/s); through disk: save {w['disk_save_s']:.2f} s, load "
                f"{w['disk_load_s']:.2f} s. NCCL: {w['nccl']}."
            ]
        )
    if "families" in s:
        lines += ["", "## Every family: PPO steps and greedy decoding", ""]
        lines += (
            [f"Error: {s['families']['error']}"]
            if "error" in s["families"]
            else [
                "| family | model | parameters | torch engine | Megatron engine | greedy = generate() |",
                "|---|---|---|---|---|---|",
            ]
            + [
                f"| {family} | {row['model']} | {row['parameters'] / 1e6:,.1f}M | {_family_cell(row['torch_engine'])} | "
                f"{_family_cell(row['megatron_engine'])} | "
                + (
                    f"error: {row['greedy']['error']}"
                    if "error" in row["greedy"]
                    else f"{row['greedy']['equal']}/{row['greedy']['sequences']}"
                )
                + " |"
                for family, row in s["families"]["rows"].items()
            ]
        )
    lines += ["", "Seconds per section: " + ", ".join(f"{k} {v['seconds']:.1f}" for k, v in s.items()) + "."]
    return "\n".join(lines)


def _family_cell(e: dict) -> str:
    if "error" in e:
        return f"error: {e['error']}"
    return f"{e['tokens_per_s']:.0f} tokens/s, MFU {_fmt(e['mfu'], '.1%')}, {_fmt(e['peak_memory_gib'], '.1f')} GiB"


def _engine_row(name: str, e: dict) -> str:
    if "error" in e:
        return f"- **{name}**: error: {e['error']}"
    return (
        f"- **{name}** PPO step ({e['compute']}): {e['tokens']} tokens in {e['sequences']} sequences, "
        f"{_fmt(e['microbatches'], '.0f')} micro-batches: {e['s_per_step']:.3f} s/step, "
        f"{e['tokens_per_s']:.0f} tokens/s, {e['tflops']:.1f} TFLOP/s, MFU {_fmt(e['mfu'], '.1%')}, "
        f"peak memory {_fmt(e['peak_memory_gib'], '.1f')} GiB."
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: the same code paths, for CI")
    parser.add_argument(
        "--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_check-"), help="folder for every output"
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, choices=model_names(), help=f"the catalogued model (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run these sections only")
    parser.add_argument(
        "--set",
        nargs="+",
        metavar="KEY=VALUE",
        help="config overrides of the trainer sections, e.g. actor.recompute=full",
    )
    parser.add_argument("--save", action="store_true", help="also record the result in bench/results/")
    arguments = parser.parse_args()
    result = run(arguments)
    print(report(result))
    print(f"[gpu_check] written to {arguments.out}", flush=True)
    if arguments.save:
        save("gpu_check" + ("-dry-run" if arguments.dry_run else ""), result, report(result))
    sys.exit(1 if any("error" in section for section in result["sections"].values()) else 0)
