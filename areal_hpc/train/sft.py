"""Supervised fine-tuning of a causal LM on a task's reference completions.

    areal-hpc sft --config configs/sft_tiny.yaml [key=value ...]

SFT is a loss function (mean NLL of the completion tokens) on the engine the RL actor trains with
(``actor.engine``, built by ``engines.factory.build_engine`` for the role "sft"): the same packed micro-batches
(no padding), AdamW with warm-up + decay and gradient clipping, in the loop DPO and the reward model share
(``train.supervised``). Held-out greedy evaluation before, during and after training runs the embedded rollout
engine on the model (``train.evaluate.HeldOutTask``); it never touches the training RNG or data order, so
evaluating changes nothing trained. ``sft.stop_at_accuracy`` ends training at the first evaluation that reaches
it: SFT's accuracy rises steeply at a point that varies with the seed, so a fixed step count lands anywhere from
10% to 35% (500 steps, 3 seeds) where a target lands within one evaluation's rise.
A tool agent's demonstration (``tools`` with its messages, or the model's turns as assistant messages instead of a
target) is rendered by the proxy's renderer, as the agent's requests are at rollout time (``train.demonstrations``).
HF-format checkpoints, metrics in JSONL and TensorBoard, a PNG curve. One process on CPU or one accelerator.
Simplifications on purpose: no resume (SFT here is a minutes-long warm-up), no data parallelism.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from areal_hpc.algo.ppo import token_weights
from areal_hpc.config import RunConfig, save_resolved
from areal_hpc.data.registry import corpus_for_tokenizer
from areal_hpc.data.tasks import Example
from areal_hpc.engines.base import TrainEngine
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.models.chat import completion_ids, example_prompt_ids
from areal_hpc.models.tiny import count_parameters, init_model
from areal_hpc.proxy.chat_template import ChatTokenizer
from areal_hpc.train.demonstrations import chat_sequences, check_demonstrations, is_agent_demo
from areal_hpc.train.evaluate import EvalResult, HeldOutTask
from areal_hpc.train.metrics import MetricsLogger
from areal_hpc.train.supervised import (
    SupervisedJob,
    index_stream,
    load_engine,
    run_supervised,
    save_model,
    seeded_device,
)
from areal_hpc.train.task_setup import open_task


@dataclass
class SFTResult:
    before: EvalResult
    after: EvalResult
    model_dir: Path
    seconds: float


def sft_sequences(tokenizer, example: Example, chat: ChatTokenizer | None = None) -> list[tuple[list[int], list[int]]]:
    """An example's token ids and loss mask (1 on the model's tokens): its prompt through the tokenizer's chat
    template and its target; a tool agent's demonstration (with ``tools``, or without a target) by
    ``chat_sequences`` on ``chat`` (default: the proxy's renderer of the tokenizer's folder), one sequence per
    record the proxy would make of it."""
    if is_agent_demo(example):
        return chat_sequences(chat or ChatTokenizer(tokenizer.name_or_path), example)
    prompt, completion = example_prompt_ids(tokenizer, example), completion_ids(tokenizer, example.target)
    return [(prompt + completion, [0] * len(prompt) + [1] * len(completion))]


class LazySequences:
    """The training examples' sequences (tokens, loss mask), each example tokenised the first time a batch
    draws it: SFT starts at once on a large dataset instead of tokenising all of it first. ``chat``: the
    proxy's renderer of the tokenizer's folder, for tool agents' demonstrations."""

    def __init__(self, tokenizer, examples: list, chat: ChatTokenizer | None = None):
        self.tokenizer, self.examples, self.chat, self.tokenised = tokenizer, examples, chat, {}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> list[tuple[list[int], list[int]]]:
        if index not in self.tokenised:
            self.tokenised[index] = sft_sequences(self.tokenizer, self.examples[index], self.chat)
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
    device = seeded_device(cfg)
    model_dir = prepare_model_dir(cfg)
    engine = load_engine("sft", cfg, model_dir)
    tokenizer, model = engine.tokenizer, engine.model  # the Hugging Face model held-out evaluation generates with
    folder = cfg.tokenizer.path or model_dir
    task = open_task(cfg, tokenizer, folder, console.print)
    chat = check_demonstrations(task.train, folder)  # the proxy's renderer, for tool agents' demonstrations
    train = LazySequences(tokenizer, task.train, chat)
    held_out = HeldOutTask(cfg, task, tokenizer, model_dir)  # its workflow built, its reward loaded
    save_resolved(cfg)  # only once every input has been checked: a bad one leaves the folder as it was
    console.print(
        f"[bold]SFT[/] {task.name}: {len(task.train)} train / {len(task.eval)} eval problems, "
        f"model {count_parameters(model) / 1e6:.2f}M params on {device}, run folder {cfg.run_dir}",
        soft_wrap=True,
    )

    metrics = MetricsLogger(cfg.run_dir, tensorboard=cfg.stats.tensorboard)
    order = index_stream(len(train), cfg.experiment.seed)

    def run_eval(step: int) -> EvalResult:
        result = held_out.evaluate(model)
        metrics.log(step, result.scalars())
        return result

    def train_step() -> dict[str, float]:
        tick = time.time()
        stats = sft_step(engine, [pair for _ in range(cfg.sft.batch_size) for pair in train[next(order)]])
        stats["train/tokens_per_s"] = stats["train/tokens"] / (time.time() - tick)
        return stats

    def reached(result: EvalResult) -> str | None:
        target = cfg.sft.stop_at_accuracy
        return f"reached sft.stop_at_accuracy {target:.0%}" if target and result.accuracy >= target else None

    job = SupervisedJob(
        name="sft",
        title="SFT",
        steps=cfg.sft.total_train_steps,
        eval_every=cfg.sft.eval_every_steps,
        save_every=cfg.saver.freq_steps,
        step=train_step,
        evaluate=run_eval,
        describe=lambda result: f"eval accuracy {result.summary()}{result.failed()}",
        note=lambda stats, result: f"acc {result.summary()}  {stats['train/tokens_per_s']:.0f} tok/s",
        stop=reached,
    )
    try:
        before, after = run_supervised(job, engine, metrics, console, cfg.run_dir)
    finally:
        held_out.close()
        metrics.close()
    curves = {"train loss": "train/loss", "eval accuracy": "eval/accuracy"}
    out = save_model(engine, cfg, metrics, "sft", curves, f"SFT on {task.name}")
    return SFTResult(before, after, out, time.time() - started)
