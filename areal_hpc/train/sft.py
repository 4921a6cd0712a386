"""Supervised fine-tuning of a causal LM on a task's reference completions.

    areal-hpc sft --config configs/sft_tiny.yaml [key=value ...]

One process on CPU or one accelerator: AdamW with warm-up + decay, gradient clipping, packed
micro-batches (no padding), loss on completion tokens only, greedy held-out evaluation before,
during and after training, HF-format checkpoints, metrics in JSONL and TensorBoard, a PNG curve.
Simplifications on purpose: no resume (SFT here is a minutes-long warm-up), no data parallelism.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from areal_hpc.algo.packing import allocate_microbatches, pack
from areal_hpc.config import RunConfig, save_resolved
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.registry import build_task, corpus_for_tokenizer
from areal_hpc.data.tasks import Example
from areal_hpc.models.chat import completion_ids, prompt_ids
from areal_hpc.models.hf import load_model, load_tokenizer, save_model
from areal_hpc.models.tiny import count_parameters, init_model
from areal_hpc.parallel.device import resolve_device
from areal_hpc.train.evaluate import EvalResult, evaluate
from areal_hpc.train.logprobs import packed_token_logprobs
from areal_hpc.train.metrics import MetricsLogger
from areal_hpc.train.optim import build_optimizer, build_scheduler
from areal_hpc.train.plots import plot_curves


@dataclass
class SFTResult:
    before: EvalResult
    after: EvalResult
    model_dir: Path
    seconds: float


def sft_sequence(tokenizer, example: Example) -> tuple[list[int], list[int]]:
    """Prompt + completion ids and the loss mask (1 on completion tokens)."""
    prompt, completion = prompt_ids(tokenizer, example.prompt), completion_ids(tokenizer, example.target)
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def index_stream(n: int, seed: int):
    """Endless shuffled passes over range(n), each pass a fresh seeded permutation."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield from torch.randperm(n, generator=generator).tolist()


def sft_step(model, optimizer, sequences, masks, max_tokens_per_mb: int, clip: float, device) -> dict:
    """One optimizer step: mean token NLL over the whole batch, accumulated over packed micro-batches."""
    groups = allocate_microbatches([len(s) for s in sequences], max_tokens_per_mb)
    packed = [pack([sequences[i] for i in g], [masks[i] for i in g]) for g in groups]
    n_targets = sum(p.n_targets for p in packed)
    optimizer.zero_grad(set_to_none=True)
    loss_total = 0.0
    for batch in packed:
        loss = -packed_token_logprobs(model, batch.to(device)).sum() / n_targets
        loss.backward()
        loss_total += loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    optimizer.step()
    return {"train/loss": loss_total, "train/grad_norm": float(grad_norm),
            "train/tokens": float(sum(map(len, sequences))), "train/microbatches": float(len(packed))}


def prepare_model_dir(cfg: RunConfig) -> Path:
    """The model to start from: ``model.path``, or a fresh ``model.preset`` written into the run folder."""
    if cfg.model.path:
        return Path(cfg.model.path)
    return init_model(cfg.run_dir / "init_model", corpus_for_tokenizer(cfg.experiment.seed), preset=cfg.model.preset,
                      seed=cfg.experiment.seed)


def run_sft(cfg: RunConfig, console: Console | None = None) -> SFTResult:
    console = console or Console()
    started = time.time()
    torch.manual_seed(cfg.experiment.seed)
    device = resolve_device(cfg.cluster.device)
    model_dir = prepare_model_dir(cfg)
    model = load_model(model_dir, cfg.model.dtype, cfg.model.attn_impl, device)
    tokenizer = load_tokenizer(cfg.tokenizer.path or model_dir)
    task = build_task(cfg.dataset)
    train = [sft_sequence(tokenizer, ex) for ex in task.train]
    save_resolved(cfg)  # only once every input has been checked: a bad one leaves the folder as it was
    console.print(f"[bold]SFT[/] {task.name}: {len(task.train)} train / {len(task.eval)} eval problems, "
                  f"model {count_parameters(model) / 1e6:.2f}M params on {device}, run folder {cfg.run_dir}",
                  soft_wrap=True)

    optimizer = build_optimizer(model, cfg.optimizer, lr=cfg.sft.lr)
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.sft.total_train_steps)
    metrics = MetricsLogger(cfg.run_dir, tensorboard=cfg.stats.tensorboard)
    rewards = RewardPool(task.reward)
    order = index_stream(len(train), cfg.experiment.seed)

    def run_eval(step: int) -> EvalResult:
        result = evaluate(model, tokenizer, task.eval, rewards, cfg.gconfig.max_new_tokens)
        metrics.log(step, result.scalars())
        return result

    try:
        before = after = run_eval(0)
        console.print(f"eval accuracy before SFT: [bold]{before.summary()}[/]", soft_wrap=True)
        columns = [TextColumn("[bold]sft"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("loss {task.fields[loss]:.3f}  acc {task.fields[acc]}  {task.fields[tps]:.0f} tok/s")]
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task("sft", total=cfg.sft.total_train_steps, loss=float("nan"),
                                    acc=before.summary(), tps=0.0)
            for step in range(1, cfg.sft.total_train_steps + 1):
                tick = time.time()
                picked = [train[next(order)] for _ in range(cfg.sft.batch_size)]
                stats = sft_step(model, optimizer, [s for s, _ in picked], [m for _, m in picked],
                                 cfg.sft.max_tokens_per_mb, cfg.optimizer.gradient_clipping, device)
                stats["train/lr"] = scheduler.get_last_lr()[0]
                scheduler.step()
                stats["train/tokens_per_s"] = stats["train/tokens"] / (time.time() - tick)
                metrics.log(step, stats)
                last = step == cfg.sft.total_train_steps
                if last or (cfg.sft.eval_every_steps and step % cfg.sft.eval_every_steps == 0):
                    after = run_eval(step)
                    progress.console.print(f"step {step}: eval accuracy {after.summary()}", soft_wrap=True)
                if cfg.saver.freq_steps and step % cfg.saver.freq_steps == 0 and not last:
                    save_model(model, tokenizer, cfg.run_dir / "checkpoints" / f"step{step}")
                progress.update(bar, advance=1, loss=stats["train/loss"], acc=after.summary(),
                                tps=stats["train/tokens_per_s"])
    finally:
        rewards.close()
        metrics.close()

    out = save_model(model, tokenizer, cfg.run_dir / "model")
    if cfg.stats.plot:
        plot_curves(metrics.records, {"train loss": "train/loss", "eval accuracy": "eval/accuracy"},
                    cfg.run_dir / "sft_curves.png", f"SFT on {task.name}")
    return SFTResult(before, after, out, time.time() - started)
