"""Supervised fine-tuning of a causal LM on a task's reference completions.

    areal-hpc sft --config configs/sft_tiny.yaml [key=value ...]

SFT is a loss function (mean NLL of the completion tokens) on the engine the RL actor trains with
(``actor.engine``, built by ``engines.factory.build_engine`` for the role "sft"): the same packed
micro-batches (no padding), AdamW with warm-up + decay and gradient clipping. Held-out greedy evaluation
before, during and after training runs the embedded rollout engine on the model (``train.evaluate``); it
never touches the training RNG or data order, so evaluating changes nothing trained. ``sft.stop_at_accuracy``
ends training at the first evaluation that reaches it: SFT's accuracy rises steeply at a point that varies
with the seed, so a fixed step count lands anywhere from 10% to 35% (500 steps, 3 seeds) where a target
lands within one evaluation's rise.
HF-format checkpoints, metrics in JSONL and TensorBoard, a PNG curve. One process on CPU or one accelerator.
Simplifications on purpose: no resume (SFT here is a minutes-long warm-up), no data parallelism.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from areal_hpc.agents.engine import Sampling
from areal_hpc.agents.registry import build_workflow
from areal_hpc.algo.ppo import token_weights
from areal_hpc.config import RunConfig, save_resolved
from areal_hpc.data.registry import corpus_for_tokenizer
from areal_hpc.data.tasks import Example
from areal_hpc.engines.base import TrainEngine
from areal_hpc.engines.factory import build_engine
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.errors import UserError
from areal_hpc.models.chat import completion_ids, example_prompt_ids
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.models.tiny import count_parameters, init_model
from areal_hpc.parallel.device import check_precision, resolve_device
from areal_hpc.train.evaluate import EvalResult, evaluate_model
from areal_hpc.train.metrics import MetricsLogger
from areal_hpc.train.plots import plot_curves
from areal_hpc.train.task_setup import open_task, reward_pool


@dataclass
class SFTResult:
    before: EvalResult
    after: EvalResult
    model_dir: Path
    seconds: float


def sft_sequence(tokenizer, example: Example) -> tuple[list[int], list[int]]:
    """Prompt + completion ids and the loss mask (1 on completion tokens)."""
    prompt, completion = example_prompt_ids(tokenizer, example), completion_ids(tokenizer, example.target)
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def index_stream(n: int, seed: int):
    """Endless shuffled passes over range(n), each pass a fresh seeded permutation."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield from torch.randperm(n, generator=generator).tolist()


class LazySequences:
    """The training examples as (tokens, completion mask), each tokenised the first time a batch draws
    it: SFT starts at once on a large dataset instead of tokenising all of it first."""

    def __init__(self, tokenizer, examples: list):
        self.tokenizer, self.examples, self.tokenised = tokenizer, examples, {}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> tuple[list[int], list[int]]:
        if index not in self.tokenised:
            self.tokenised[index] = sft_sequence(self.tokenizer, self.examples[index])
        return self.tokenised[index]


def sft_batch(pairs: list[tuple[list[int], list[int]]]) -> SequenceBatch:
    """Sequences with their ``weights`` field: 1 / (completion tokens of the whole batch) on every
    completion target, so the summed loss over micro-batches is the batch's mean token NLL."""
    batch = SequenceBatch([s for s, _ in pairs], [m for _, m in pairs])
    packed, _ = batch.packed()
    batch.set_packed(
        "weights",
        token_weights(
            packed.target_mask, packed.cu_seqlens, "token-mean", n_tokens=packed.n_targets, n_seqs=len(batch), max_len=1
        ),
    )
    return batch


def sft_loss(outputs: dict[str, torch.Tensor], packed, fields: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """Σ weights · (−log p) over a micro-batch (logprobs at temperature 1: the data's likelihood)."""
    return -(fields["weights"] * outputs["logprobs"]).sum(), {}


def sft_step(engine: TrainEngine, pairs: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """One optimizer step of SFT on the engine; ``train/*`` statistics."""
    batch = sft_batch(pairs)
    stats = engine.train_step(batch, sft_loss)
    return {f"train/{key}": value for key, value in stats.items()} | {"train/tokens": float(batch.n_tokens)}


def prepare_model_dir(cfg: RunConfig) -> Path:
    """The model to start from: ``model.path``, or a fresh ``model.preset`` written into the run folder."""
    if cfg.model.path:
        return Path(cfg.model.path)
    return init_model(
        cfg.run_dir / "init_model",
        corpus_for_tokenizer(cfg.experiment.seed),
        preset=cfg.model.preset,
        seed=cfg.experiment.seed,
    )


def run_sft(cfg: RunConfig, console: Console | None = None) -> SFTResult:
    console = console or Console()
    started = time.time()
    torch.manual_seed(cfg.experiment.seed)
    device = resolve_device(cfg.cluster.device)
    check_precision(device, model_dtype=cfg.model.dtype, model_compute_dtype=cfg.model.compute_dtype)
    model_dir = prepare_model_dir(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer.path or model_dir)
    engine = build_engine("sft", cfg, None, model_dir, tokenizer)
    model = engine.model  # the Hugging Face model held-out evaluation generates with
    task = open_task(cfg, tokenizer, cfg.tokenizer.path or model_dir, console.print)
    if cfg.sft.stop_at_accuracy and not cfg.sft.eval_every_steps:
        raise UserError(
            f"config key 'sft.stop_at_accuracy' = {cfg.sft.stop_at_accuracy:g} needs evaluations to "
            "check it: set sft.eval_every_steps (e.g. 25)"
        )
    if not all(ex.target for ex in task.train):
        raise UserError(
            f"config key 'dataset.target_field': SFT trains on reference completions; "
            f"{task.train[0].uid} has none (name the column that holds them)"
        )
    train = LazySequences(tokenizer, task.train)
    workflow = build_workflow(cfg.rollout)
    save_resolved(cfg)  # only once every input has been checked: a bad one leaves the folder as it was
    console.print(
        f"[bold]SFT[/] {task.name}: {len(task.train)} train / {len(task.eval)} eval problems, "
        f"model {count_parameters(model) / 1e6:.2f}M params on {device}, run folder {cfg.run_dir}",
        soft_wrap=True,
    )

    metrics = MetricsLogger(cfg.run_dir, tensorboard=cfg.stats.tensorboard)
    rewards = reward_pool(cfg, task)
    order = index_stream(len(train), cfg.experiment.seed)

    def run_eval(step: int) -> EvalResult:
        result = evaluate_model(
            model,
            tokenizer,
            task.eval,
            rewards,
            Sampling.from_config(cfg.gconfig),
            workflow,
            cfg.tokenizer.path or model_dir,
            discount=cfg.rollout.turn_discount,
        )
        metrics.log(step, result.scalars())
        return result

    try:
        before = after = run_eval(0)
        console.print(f"eval accuracy before SFT: [bold]{before.summary()}[/]", soft_wrap=True)
        columns = [
            TextColumn("[bold]sft"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("loss {task.fields[loss]:.3f}  acc {task.fields[acc]}  {task.fields[tps]:.0f} tok/s"),
        ]
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task(
                "sft", total=cfg.sft.total_train_steps, loss=float("nan"), acc=before.summary(), tps=0.0
            )
            for step in range(1, cfg.sft.total_train_steps + 1):
                tick = time.time()
                stats = sft_step(engine, [train[next(order)] for _ in range(cfg.sft.batch_size)])
                stats["train/tokens_per_s"] = stats["train/tokens"] / (time.time() - tick)
                metrics.log(step, stats)
                last = step == cfg.sft.total_train_steps
                evaluated = last or bool(cfg.sft.eval_every_steps and step % cfg.sft.eval_every_steps == 0)
                if evaluated:
                    after = run_eval(step)
                    progress.console.print(f"step {step}: eval accuracy {after.summary()}", soft_wrap=True)
                reached = evaluated and bool(cfg.sft.stop_at_accuracy) and after.accuracy >= cfg.sft.stop_at_accuracy
                if cfg.saver.freq_steps and step % cfg.saver.freq_steps == 0 and not (last or reached):
                    engine.save(cfg.run_dir / "checkpoints" / f"step{step}", optimizer=False)
                progress.update(
                    bar, advance=1, loss=stats["train/loss"], acc=after.summary(), tps=stats["train/tokens_per_s"]
                )
                if reached:
                    progress.console.print(
                        f"step {step}: reached sft.stop_at_accuracy {cfg.sft.stop_at_accuracy:.0%}: SFT stops here",
                        soft_wrap=True,
                    )
                    break
    finally:
        rewards.close()
        metrics.close()

    out = cfg.run_dir / "model"
    engine.save(out, optimizer=False)
    if cfg.stats.plot:
        plot_curves(
            metrics.records,
            {"train loss": "train/loss", "eval accuracy": "eval/accuracy"},
            cfg.run_dir / "sft_curves.png",
            f"SFT on {task.name}",
        )
    return SFTResult(before, after, out, time.time() - started)
