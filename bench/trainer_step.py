"""The trainer's PPO step on the quickstart RL workload, before and after the trainer-step rework (issue 13),
in one run; and one PPO step of a 4k/8k-token micro-batch with per-sequence attention vs dense-mask sdpa.

    .venv/bin/python bench/trainer_step.py [--steps 8] [--presets tiny small] [--threads 1] [--save]

Workload: a batch like ``make demo``'s, 16 prompts x 8 samples: the first prompts of the quickstart's
arithmetic prompt stream under the tokenizer's chat template, each with completions of 3-8 tokens
(random ids ending in the end-of-turn token, behaviour logprobs and rewards drawn at random: the
step's cost does not depend on them), turned into the training batch by ``trajectory_batch`` as the
trainer does. Every variant trains its own copy of the same model, one step each in turn; medians.

- before: the trainer as landed at fb75a2a, rebuilt here (``LandedTrainer``): Hugging Face forward over
  packed rows (sdpa with restarting position ids: a dense block-diagonal mask), float32 log-softmax over
  the whole vocabulary at every position, 256-token micro-batches (the quickstart's setting then), the
  proximal logprobs recomputed in a separate no-grad pass, float32.
- after: today's ``build_actor`` (``TorchTrainEngine`` + ``PPOActor.update``) with the quickstart's
  settings: per-sequence attention, LM head at target positions only, 4096-token micro-batches, one
  minibatch (proximal logprobs from the update's own forward), bfloat16 autocast; and the same in float32.

The micro-batch part packs sequences of 20-400 tokens (a quarter prompt, the rest trained) into one
micro-batch of 4096 or 8192 tokens and times ``TorchTrainEngine.train_step`` (forward, PPO loss,
backward, optimizer step) in float32; the two variants differ only in attention (both use the
target-only LM head). Torch runs on ``--threads`` threads: 1 by default, as the pinned trainer has one core.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, run_and_record

from areal_hpc.algo.packing import PackedBatch, dynamic_microbatches
from areal_hpc.algo.ppo import decoupled_ppo_loss, token_weights
from areal_hpc.algo.temperature import run_temperature
from areal_hpc.config import RunConfig, load_config
from areal_hpc.data.prompts import PromptStream
from areal_hpc.data.registry import build_task, corpus_for_tokenizer
from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.engines.optim import build_optimizer, build_scheduler
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.engines.torch import outputs
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import packed_policy_outputs
from areal_hpc.models.chat import prompt_ids
from areal_hpc.models.hf import load_model, load_tokenizer
from areal_hpc.models.tiny import count_parameters, init_model
from areal_hpc.resolve import Host, resolve
from areal_hpc.train.actor import loss_config
from areal_hpc.train.build import build_actor
from areal_hpc.train.trajectory_batch import build_batch, split_minibatches

CONFIG = "configs/quickstart.yaml"
LANDED_TOKENS_PER_MB = 256  # actor.max_tokens_per_mb of the quickstart at fb75a2a


def quickstart_trajectories(
    cfg: RunConfig, tokenizer, rng: np.random.Generator, output_tokens: tuple[int, int] = (3, 8)
) -> list[Trajectory]:
    """One training batch of the quickstart: consumer_batch_size prompts x n_samples completions of
    ``output_tokens`` (least, most) tokens."""
    prompts = PromptStream(build_task(cfg.dataset).train, cfg.experiment.seed)
    specials = set(tokenizer.all_special_ids)
    words = np.array([i for i in range(len(tokenizer)) if i not in specials])
    batch = []
    for g in range(cfg.rollout.consumer_batch_size):
        prompt = prompt_ids(tokenizer, next(prompts).prompt)
        for _ in range(cfg.generation.n_samples):
            n = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
            output = [*rng.choice(words, n - 1).tolist(), tokenizer.eos_token_id]
            segment = Segment(prompt, output, -rng.exponential(1.0, n), np.zeros(n))
            batch.append(Trajectory([segment], group_id=f"g{g}", rewards=[Reward(float(rng.random() < 0.3))]))
    return batch


def landed_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float) -> torch.Tensor:
    """fb75a2a's ``packed_token_logprobs``: full logits, float32 log-softmax over the vocabulary everywhere."""
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0]
    next_tokens = torch.roll(batch.input_ids[0], shifts=-1)
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, next_tokens[:, None])[:, 0]
    return torch.where(batch.target_mask, logprobs, torch.zeros_like(logprobs))


class LandedTrainer:
    """The engine and ``PPOActor.update`` of fb75a2a, one rank: a no-grad recompute of the proximal logprobs,
    then one optimizer step per minibatch, both in ``max_tokens_per_mb`` micro-batches, float32."""

    def __init__(self, cfg: RunConfig, temperature: float, max_tokens_per_mb: int = LANDED_TOKENS_PER_MB):
        self.model = load_model(cfg.model.path, cfg.model.dtype, cfg.model.attn_impl)
        self.temperature, self.max_tokens_per_mb, self.clip = (
            temperature,
            max_tokens_per_mb,
            cfg.optimizer.gradient_clipping,
        )
        self.optimizer = build_optimizer(self.model, cfg.optimizer, cfg.actor.lr)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, cfg.rl.total_train_steps)
        self.loss_cfg = loss_config(cfg.actor)

    def _microbatches(self, batch: SequenceBatch):
        for indices in dynamic_microbatches([len(s) for s in batch.sequences], self.max_tokens_per_mb):
            packed, fields = batch.select(indices).packed()
            yield indices, packed, fields

    @torch.no_grad()
    def forward(self, batch: SequenceBatch) -> list[torch.Tensor]:
        self.model.eval()
        out: list[torch.Tensor | None] = [None] * len(batch)
        for indices, packed, _ in self._microbatches(batch):
            values = landed_logprobs(self.model, packed, self.temperature)
            for i, part in zip(indices, values.split([len(batch.sequences[i]) for i in indices])):
                out[i] = part
        return out

    def train_step(self, batch: SequenceBatch) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        for _, packed, f in self._microbatches(batch):
            loss, _ = decoupled_ppo_loss(
                landed_logprobs(self.model, packed, self.temperature),
                f["prox_logprobs"],
                f["behav_logprobs"],
                f["advantages"],
                packed.target_mask,
                packed.cu_seqlens,
                f["weights"],
                self.loss_cfg,
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip if self.clip > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()

    def update(self, minibatches: list[SequenceBatch]) -> dict[str, float]:
        started = time.perf_counter()
        for mb in minibatches:
            mb.fields["prox_logprobs"] = self.forward(mb)
        recomputed = time.perf_counter()
        for mb in minibatches:
            self.train_step(mb)
        return {"time/logprob": recomputed - started, "time/update": time.perf_counter() - recomputed}


def quickstart_steps(cfg: RunConfig, steps: int) -> list[dict]:
    """s/step of each trainer on the same batch, one step of each in turn (the first of each not counted)."""
    tokenizer = load_tokenizer(cfg.model.path)
    trajectories = quickstart_trajectories(cfg, tokenizer, np.random.default_rng(0))
    max_new = cfg.generation.max_new_tokens
    temperature = cfg.generation.temperature
    after = {
        dtype: build_actor(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype=dtype)), None)[0]
        for dtype in ("float32", "bfloat16")
    }
    variants = {
        "before (fb75a2a: dense-mask sdpa, full-vocab log-softmax, 256-token mbs, separate recompute, float32)": LandedTrainer(
            cfg, temperature
        ).update,
        "after, float32 (per-sequence attention, target-only head, 4096-token mbs, no recompute)": after[
            "float32"
        ].update,
        "after, bfloat16 autocast (the quickstart's settings)": after["bfloat16"].update,
    }
    times: dict[str, list[dict]] = {name: [] for name in variants}
    for step in range(steps + 1):
        for name, update in variants.items():
            started = time.perf_counter()
            batch = build_batch(
                trajectories, cfg.actor, max_new, run_temperature(cfg.generation)
            )  # as TrainerRanks does
            stats = update(split_minibatches(batch, trajectories, cfg.actor, max_new))
            if step:
                times[name].append({"step": time.perf_counter() - started, **stats})
    tokens, trained = batch.n_tokens, sum(sum(m) for m in batch.loss_masks)
    rows = []
    for name, samples in times.items():
        step_s = statistics.median(s["step"] for s in samples)
        rows.append(
            {
                "trainer": name,
                "s_per_step": step_s,
                "logprob_s": statistics.median(s["time/logprob"] for s in samples),
                "update_s": statistics.median(s["time/update"] for s in samples),
                "trained_tokens_per_s": trained / step_s,
                "tokens_per_s": tokens / step_s,
            }
        )
    for row in rows:
        row["speedup_vs_before"] = rows[0]["s_per_step"] / row["s_per_step"]
    return rows, {
        "sequences": len(trajectories),
        "tokens": tokens,
        "trained_tokens": trained,
        "landed_microbatches": len(dynamic_microbatches([len(s) for s in batch.sequences], LANDED_TOKENS_PER_MB)),
    }


def dense_policy_outputs(
    model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """``packed_policy_outputs`` with the model's own sdpa over the packed row (Hugging Face builds a dense
    block-diagonal mask from the restarting position ids); everything else, the LM head included, unchanged."""
    with mock.patch.object(outputs, "packed_attention", lambda *args: contextlib.nullcontext()):
        return packed_policy_outputs(model, batch, temperature)


def mixed_length_batch(budget: int, vocab: int, rng: np.random.Generator) -> SequenceBatch:
    """Sequences of 20-400 tokens filling ``budget`` tokens; the first quarter of each is the prompt."""
    lengths = []
    while (left := budget - sum(lengths)) >= 20:
        lengths.append(min(int(rng.integers(20, 401)), left))
    sequences = [rng.integers(0, vocab, n).tolist() for n in lengths]
    masks = [[0] * (n // 4) + [1] * (n - n // 4) for n in lengths]
    batch = SequenceBatch(sequences, masks, {"behav_logprobs": [torch.full((n,), -1.0) for n in lengths]})
    packed, _ = batch.packed()
    batch.set_packed("advantages", torch.randn(packed.input_ids.shape[1]))
    batch.set_packed(
        "weights",
        token_weights(
            packed.target_mask, packed.cu_seqlens, "token-mean", n_tokens=packed.n_targets, n_seqs=len(batch), max_len=1
        ),
    )
    return batch


def microbatch_throughput(cfg: RunConfig, model_dir: Path, budget: int, repeats: int) -> dict:
    """Tokens/s of one PPO step on one micro-batch of ``budget`` tokens: per-sequence attention vs dense mask."""
    actor = build_actor(
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_dir), compute_dtype="float32")),
        None,
    )[0]
    batch = mixed_length_batch(budget, actor.actor.model.config.vocab_size, np.random.default_rng(budget))
    engines = {"per_sequence": actor.actor}
    engines["dense_mask"] = TorchTrainEngine(
        load_model(model_dir), dense_policy_outputs, optimizer=cfg.optimizer, lr=cfg.actor.lr, max_tokens_per_mb=budget
    )
    times: dict[str, list[float]] = {name: [] for name in engines}
    for repeat in range(repeats + 1):
        for name, engine in engines.items():
            started = time.perf_counter()
            engine.train_step(batch, actor._policy_loss)
            if repeat:
                times[name].append(time.perf_counter() - started)
    tokens = batch.n_tokens
    lengths = [len(s) for s in batch.sequences]
    row = {
        "tokens": tokens,
        "sequences": len(lengths),
        "length_median": int(np.median(lengths)),
        **{f"{name}_tokens_per_s": tokens / statistics.median(t) for name, t in times.items()},
    }
    row["ratio"] = row["per_sequence_tokens_per_s"] / row["dense_mask_tokens_per_s"]
    return row


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="trainer_step-") as tmp:
        models = {
            preset: init_model(Path(tmp) / preset, corpus_for_tokenizer(1), preset=preset, seed=1)
            for preset in args.presets
        }
        first = args.presets[0]
        cfg = load_config(
            CONFIG, [f"model.path={args.model or models[first]}", f"model.preset={first}", f"cluster.fileroot={tmp}"]
        )
        cfg = resolve(cfg, Host.probe()).cfg
        rows, batch = quickstart_steps(cfg, args.steps)
        load.append(os.getloadavg()[0])
        micro = []
        for preset in args.presets:
            for budget in args.mb_tokens:
                micro.append(
                    {
                        "preset": preset,
                        "parameters": count_parameters(load_model(models[preset])),
                        **microbatch_throughput(cfg, models[preset], budget, args.repeats),
                    }
                )
                print(f"  {preset} {budget}: {micro[-1]['ratio']:.2f}x", flush=True)
    load.append(os.getloadavg()[0])
    return {
        "benchmark": "trainer_step",
        "date": date.today().isoformat(),
        "machine": machine(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "repeats": args.repeats,
        "model": args.model or f"{first} (freshly initialised)",
        "batch": batch,
        "quickstart": rows,
        "microbatch": micro,
        "load_average_1min": load,
    }


def report(r: dict) -> str:
    b = r["batch"]
    lines = [
        f"# Trainer PPO step, before (fb75a2a) vs after ({r['date']})",
        "",
        f"Machine: {r['machine']}, {r['threads']} torch thread(s); 1-minute load average at start, after the "
        f"quickstart part, at the end: {', '.join(f'{x:.2f}' for x in r['load_average_1min'])}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in r["versions"].items())
        + ".",
        "",
        f"## The quickstart RL step ({r['model']}; median of {r['steps']} steps each, taken in turn)",
        "",
        f"Batch: {b['sequences']} sequences (16 prompts x 8 samples), {b['tokens']} tokens of which "
        f"{b['trained_tokens']} trained; before cuts it into {b['landed_microbatches']} micro-batches per pass, "
        "after into 1.",
        "",
        "| trainer | s/step | logprob recompute (s) | update (s) | trained tokens/s | tokens/s | vs before |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["quickstart"]:
        lines.append(
            f"| {row['trainer']} | {row['s_per_step']:.4f} | {row['logprob_s']:.4f} | {row['update_s']:.4f} | "
            f"{row['trained_tokens_per_s']:.0f} | {row['tokens_per_s']:.0f} | "
            f"**{row['speedup_vs_before']:.2f}x** |"
        )
    rows = r["quickstart"]
    lines += [
        "",
        f"bfloat16's share: after float32 / after bfloat16 = {rows[1]['s_per_step'] / rows[2]['s_per_step']:.2f}x; "
        f"after/before s/step ratio {rows[2]['s_per_step'] / rows[0]['s_per_step']:.3f} (bfloat16), "
        f"{rows[1]['s_per_step'] / rows[0]['s_per_step']:.3f} (float32).",
        "",
        f"## One PPO step of one packed micro-batch (sequences of 20-400 tokens, float32, median of {r['repeats']})",
        "",
        "| model | tokens | sequences (median length) | per-sequence attention tokens/s | dense-mask sdpa tokens/s | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for m in r["microbatch"]:
        lines.append(
            f"| {m['preset']} ({m['parameters'] / 1e6:.2f}M) | {m['tokens']} | {m['sequences']} "
            f"({m['length_median']}) | {m['per_sequence_tokens_per_s']:.0f} | {m['dense_mask_tokens_per_s']:.0f} | "
            f"**{m['ratio']:.2f}x** |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed quickstart steps per trainer")
    parser.add_argument("--repeats", type=int, default=2, help="timed micro-batch steps per variant")
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    parser.add_argument("--mb-tokens", nargs="+", type=int, default=[4096, 8192], help="micro-batch budgets")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the pinned trainer has one core)")
    parser.add_argument(
        "--model",
        default="",
        help="model of the quickstart part (default: a fresh first preset; e.g. the quickstart's SFT warm-up)",
    )
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    arguments = parser.parse_args()
    run_and_record("trainer_step", arguments, run, report)
