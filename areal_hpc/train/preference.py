"""Training on preference pairs: DPO (or IPO) of a policy, and a Bradley-Terry reward model.

    areal-hpc dpo --config configs/preference_arithmetic.yaml [key=value ...]
    areal-hpc rm  --config configs/preference_arithmetic.yaml [key=value ...]

Both objectives depend on the model only through at most two numbers per sequence: the summed
log-likelihood of the completion (DPO, and a regularised reward model) and the reward model's score after
its last token (the critic's value head, as PPO's critic). Each step runs the batch forward once without
gradients, takes the objective's derivative by each of those numbers (``algo.preference``), and trains the
engine on the sequences with those derivatives as per-token weights: the gradient is the objective's
exactly, whichever micro-batches the engine packs.
``preference.nll_weight`` adds the chosen side's mean token NLL: for DPO this is RPO (Pang et al. 2024 found
plain DPO lowers math accuracy and this term keeps the chosen answers likely); for a reward model it
regularises the body, read through the causal LM's output layer, to stay a language model of the chosen
answers (Yang et al. 2024, "Regularizing Hidden States Enables Learning Generalizable Reward Model for
LLMs"): on the quickstart's unseen problems it is what lifts pairwise accuracy from 70-83% to 90-99%
(bench/results/rm_recipe_grid-*.md). DPO's reference log-likelihoods
are the starting model's, computed once before the first step (no second model in memory) and cached
in the experiment's folder, for its other trials on the same model and pairs. Held-out pairwise accuracy (and, with
``preference.eval_task``, the policy's accuracy on the configured task) before, during and after
training; metrics in JSONL and TensorBoard, a PNG curve, the model saved in Hugging Face format.
One process, in the loop SFT runs in too (``train.supervised``).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from areal_hpc.algo.advantages import sequence_ids
from areal_hpc.algo.packing import PackedBatch
from areal_hpc.algo.preference import PairLossConfig, margin_gradients, pair_statistics, sequence_coefficients
from areal_hpc.config import RunConfig, save_resolved
from areal_hpc.engines.base import TrainEngine
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.errors import UserError
from areal_hpc.models.hf import detach_language_head
from areal_hpc.train.evaluate import HeldOutTask
from areal_hpc.train.metrics import MetricsLogger
from areal_hpc.train.preference_pairs import PreferencePair, load_pairs
from areal_hpc.train.supervised import (
    SupervisedJob,
    index_stream,
    load_engine,
    run_supervised,
    save_model,
    seeded_device,
)
from areal_hpc.train.task_setup import open_task

OBJECTIVES = ("dpo", "rm")  # each the role (``engines.base.ROLES``) its engine is built for


@dataclass
class PreferenceResult:
    before: dict[str, float]
    after: dict[str, float]
    model_dir: Path
    seconds: float


def pair_batch(pairs: list[PreferencePair]) -> SequenceBatch:
    """Prompt + chosen at 2i, prompt + rejected at 2i + 1."""
    sequences = [side for pair in pairs for side in pair.sequences()]
    return SequenceBatch([s for s, _ in sequences], [m for _, m in sequences])


class PairScorer:
    """The numbers each objective reads off a sequence, and the per-position weights that train them: a
    completion's log-likelihood (its target logprobs summed) and a reward model's score (its value after
    the last token)."""

    def __init__(self, objective: str):
        self.output = "logprobs" if objective == "dpo" else "values"

    def scores(self, engine: TrainEngine, batch: SequenceBatch) -> torch.Tensor:
        """[2n] float64: each sequence's completion log-likelihood (dpo) or its last value (rm)."""
        return self.per_sequence(engine, batch)[self.output]

    def per_sequence(self, engine: TrainEngine, batch: SequenceBatch) -> dict[str, torch.Tensor]:
        """{output: [n] float64} of each output the engine computes that a sequence can be read by."""
        packed, _ = batch.packed()
        outputs = engine.forward(batch)
        return {
            name: self.reduce(packed, torch.cat(outputs[name]).double(), name)
            for name in ("logprobs", "values")
            if name in outputs
        }

    def weights(self, packed: PackedBatch, coefficients: torch.Tensor, output: str | None = None) -> torch.Tensor:
        """Packed [T] weights w with Σ_t w_t·output_t = Σ_i coefficient_i·(sequence i's number)."""
        return self._positions(packed, output or self.output).double() * coefficients[sequence_ids(packed.cu_seqlens)]

    def reduce(self, packed: PackedBatch, per_position: torch.Tensor, output: str | None = None) -> torch.Tensor:
        """[n] each sequence's number from the packed per-position outputs."""
        selected = torch.where(self._positions(packed, output or self.output), per_position, 0.0)
        return selected.new_zeros(len(packed.cu_seqlens) - 1).index_add_(0, sequence_ids(packed.cu_seqlens), selected)

    @staticmethod
    def _positions(packed: PackedBatch, output: str) -> torch.Tensor:
        if output == "logprobs":  # position t holds the logprob of token t + 1: the completion's targets
            return packed.target_mask.bool()
        last = torch.zeros(packed.cu_seqlens[-1], dtype=torch.bool)
        last[packed.cu_seqlens[1:] - 1] = True
        return last


def weighted_outputs_loss(outputs: list[str]):
    """Σ over ``outputs`` of Σ_t weights_t·output_t, the weights in the batch's field ``weights/<output>``."""

    def loss(values: dict[str, torch.Tensor], packed, fields: dict[str, torch.Tensor]):
        return sum((fields[f"weights/{name}"] * values[name]).sum() for name in outputs), {}

    return loss


class PreferenceTrainer:
    """One objective's steps and evaluations on an engine."""

    def __init__(self, engine: TrainEngine, objective: str, cfg: RunConfig, reference: dict[str, torch.Tensor] | None):
        pcfg = cfg.preference
        self.engine, self.scorer = engine, PairScorer(objective)
        self.loss_cfg = PairLossConfig(
            loss=pcfg.loss if objective == "dpo" else "bradley_terry",
            beta=pcfg.beta,
            label_smoothing=pcfg.label_smoothing if objective == "dpo" else 0.0,
        )
        self.scale = pcfg.beta if objective == "dpo" else 1.0  # DPO's implicit reward is β·(log π − log π_ref)
        self.nll_weight = pcfg.nll_weight
        self.reference = reference

    def _sides(self, scores: torch.Tensor, split: str, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) [n] scores: log-likelihood ratios to the reference for DPO."""
        if self.reference is not None:
            scores = scores - self.reference[split][torch.tensor(indices)].reshape(-1)
        return scores[0::2], scores[1::2]

    def step(self, pairs: list[PreferencePair], indices: list[int]) -> dict[str, float]:
        batch = pair_batch(pairs)
        stats, outputs = self.weigh(batch, pairs, indices)
        stats = self.engine.train_step(batch, weighted_outputs_loss(outputs)) | stats  # its "loss" is the surrogate's
        return {f"train/{key}": value for key, value in stats.items()} | {"train/tokens": float(batch.n_tokens)}

    def weigh(
        self, batch: SequenceBatch, pairs: list[PreferencePair], indices: list[int]
    ) -> tuple[dict[str, float], list[str]]:
        """Set the batch's per-position weights (``weights/<output>``) whose weighted sum of the engine's
        outputs has the objective's gradient; (the objective's value and the pairs' statistics, the
        outputs weighted)."""
        numbers = self.scorer.per_sequence(self.engine, batch)
        chosen, rejected = self._sides(numbers[self.scorer.output], "train", indices)
        loss, by_score, by_likelihood, extra = sequence_coefficients(
            chosen,
            rejected,
            self.loss_cfg,
            self.nll_weight,
            numbers.get("logprobs", torch.zeros(0))[0::2],
            torch.tensor([len(pair.chosen_ids) for pair in pairs]),
        )
        packed = batch.packed()[0]
        weights = {self.scorer.output: self.scorer.weights(packed, by_score)}
        if self.nll_weight:
            weights["logprobs"] = weights.get("logprobs", 0.0) + self.scorer.weights(packed, by_likelihood, "logprobs")
        for name, values in weights.items():
            batch.set_packed(f"weights/{name}", values.float())
        # the objective, not the weighted surrogate the engine sums
        stats = {"loss": float(loss), **pair_statistics(chosen - rejected, chosen, rejected, self.scale), **extra}
        return stats, list(weights)

    @torch.no_grad()
    def evaluate(self, pairs: list[PreferencePair], batch_size: int) -> dict[str, float]:
        chosen, rejected = [], []
        for start in range(0, len(pairs), batch_size):
            part = list(range(start, min(start + batch_size, len(pairs))))
            batch = pair_batch([pairs[i] for i in part])
            c, r = self._sides(self.scorer.scores(self.engine, batch), "eval", part)
            chosen.append(c)
            rejected.append(r)
        chosen, rejected = torch.cat(chosen), torch.cat(rejected)
        loss, _ = margin_gradients(chosen - rejected, self.loss_cfg)
        stats = {"loss": float(loss), **pair_statistics(chosen - rejected, chosen, rejected, self.scale)}
        return {f"eval/pair_{key}": value for key, value in stats.items()}


def reference_scores(
    engine: TrainEngine, splits: dict[str, list[PreferencePair]], folder: Path, model_dir: Path, batch_size: int, say
) -> dict[str, torch.Tensor]:
    """{split: [n, 2] float64 (chosen, rejected) log-likelihoods} of the starting model, read from the cache
    ``folder`` when it holds those of the same model and pairs (one file each, shared by concurrent runs)."""
    digest = hashlib.sha256(str(model_dir.resolve()).encode())
    for name in sorted(splits):
        for pair in splits[name]:
            digest.update(repr((name, pair.prompt_ids, pair.chosen_ids, pair.rejected_ids)).encode())
    cache = folder / f"{digest.hexdigest()}.pt"
    if cache.is_file():
        say(f"reference log-likelihoods read from {cache}")
        return torch.load(cache, weights_only=True)
    scorer, scores = PairScorer("dpo"), {}
    for name, pairs in splits.items():
        parts = [scorer.scores(engine, pair_batch(pairs[i : i + batch_size])) for i in range(0, len(pairs), batch_size)]
        scores[name] = torch.cat(parts).reshape(-1, 2) if parts else torch.zeros(0, 2, dtype=torch.float64)
    folder.mkdir(parents=True, exist_ok=True)
    written = cache.with_suffix(f".{os.getpid()}.partial")  # whole or not at all, whichever trial writes it
    torch.save(scores, written)
    os.replace(written, cache)
    return scores


def run_preference(cfg: RunConfig, objective: str, console: Console | None = None) -> PreferenceResult:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}; valid: {', '.join(OBJECTIVES)}")
    console, started, pcfg = console or Console(), time.time(), cfg.preference
    if not cfg.model.path:
        raise UserError(
            f"config key 'model.path' is empty: {objective} starts from a trained model (e.g. the SFT "
            "checkpoint <run>/model)"
        )
    seeded_device(cfg)
    model_dir = Path(cfg.model.path)
    engine = load_engine(objective, cfg, model_dir)  # the reward model's regulariser included
    tokenizer = engine.tokenizer
    model = engine.model  # the Hugging Face module: its context, the policy's evaluation, the head detached at the end
    context = getattr(model.config, "max_position_embeddings", 1 << 30)
    train, held_out = load_pairs(pcfg, cfg.experiment.seed, tokenizer, context, console.print)
    task = None  # the policy's held-out accuracy on the configured task (``dataset.*``), as SFT reports it
    if objective == "dpo" and pcfg.eval_task:
        task = HeldOutTask(
            cfg, open_task(cfg, tokenizer, cfg.tokenizer.path or model_dir, console.print), tokenizer, model_dir
        )
    save_resolved(cfg)  # only once every input has been checked
    console.print(
        f"[bold]{objective.upper()}[/] on {len(train)} pairs ({len(held_out)} held out) from "
        f"{pcfg.path}, starting from {model_dir}; run folder {cfg.run_dir}",
        soft_wrap=True,
    )
    reference = None
    if objective == "dpo":
        cache = Path(cfg.cluster.fileroot) / cfg.experiment.name / "reference_logprobs"  # shared by the trials
        reference = reference_scores(
            engine, {"train": train, "eval": held_out}, cache, model_dir, pcfg.batch_size, console.print
        )
    trainer = PreferenceTrainer(engine, objective, cfg, reference)
    metrics = MetricsLogger(cfg.run_dir, tensorboard=cfg.stats.tensorboard)
    order = index_stream(len(train), cfg.experiment.seed)

    def run_eval(step: int) -> dict[str, float]:
        scalars = trainer.evaluate(held_out, pcfg.batch_size) if held_out else {}
        if task is not None:
            scalars.update(task.evaluate(model).scalars())
        metrics.log(step, scalars)
        return scalars

    def train_step() -> dict[str, float]:
        indices = [next(order) for _ in range(pcfg.batch_size)]
        return trainer.step([train[i] for i in indices], indices)

    job = SupervisedJob(
        name=objective,
        title=objective.upper(),
        steps=pcfg.total_train_steps,
        eval_every=pcfg.eval_every_steps,
        save_every=0,  # the final model only (a reward model's language head is detached before it is saved)
        step=train_step,
        evaluate=run_eval,
        describe=lambda scalars: f"held out {_summary(scalars)}",
        note=lambda stats, scalars: f"pair acc {stats['train/accuracy']:.3f}",
    )
    try:
        before, after = run_supervised(job, engine, metrics, console, cfg.run_dir)
    finally:
        metrics.close()
        if task is not None:
            task.close()
    detach_language_head(model)  # the reward model is the critic; its language head only regularised it
    curves = {"train loss": "train/loss", "held-out pair accuracy": "eval/pair_accuracy"}
    if task is not None:
        curves["held-out task accuracy"] = "eval/accuracy"
    out = save_model(engine, cfg, metrics, objective, curves, objective.upper())
    return PreferenceResult(before, after, out, time.time() - started)


def _summary(scalars: dict[str, float]) -> str:
    parts = [f"pair accuracy {scalars['eval/pair_accuracy']:.1%}, margin {scalars['eval/pair_reward_margin']:+.3f}"]
    if "eval/accuracy" in scalars:
        parts.append(f"task accuracy {scalars['eval/accuracy']:.1%}")
    return "; ".join(parts) if "eval/pair_accuracy" in scalars else "no held-out pairs"
