"""A reward model scoring one RL step's rollouts in the reward pool: in batches (``score_batch``, what
``reward.model`` does) against one completion per call (the same model behind a plain reward function,
how it was scored before), alternating, in one run:

    .venv/bin/python bench/reward_model_scoring.py [--model runs/.../preference/rm/model] [--save]

Requests have the quickstart's shape by default: 16 prompts x 8 samples, prompts of 20-30 tokens,
completions of 1-8 (``--completion-tokens`` for longer ones). Without ``--model`` the reward model is
a critic of a fresh tiny model (scoring cost depends on sizes, not on training).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, run_and_record

from areal_hpc.data.rewards import RewardPool, RewardRequest
from areal_hpc.train.reward_model import RewardModelScore


class OneAtATime:
    """The reward model as a plain reward function: the pool calls it once per completion."""

    def __init__(self, score: RewardModelScore):
        self.score = score

    def load(self):
        return self.score.load()

    def __call__(self, *args, **fields) -> float:
        return self.score(*args, **fields)


def reward_model(path: Path | None, tmp: Path) -> RewardModelScore:
    if path is not None:
        return RewardModelScore(str(path))
    from areal_hpc.data.registry import corpus_for_tokenizer
    from areal_hpc.models.hf import load_critic, load_tokenizer, save_model
    from areal_hpc.models.tiny import init_model

    model = init_model(tmp / "model", corpus_for_tokenizer(0), preset="tiny", seed=0)
    return RewardModelScore(str(save_model(load_critic(model), load_tokenizer(model), tmp / "critic")))


def step_requests(args, vocab: int, step: int) -> list[RewardRequest]:
    generator = torch.Generator().manual_seed(step)

    def tokens(low: int, high: int) -> list[int]:
        n = int(torch.randint(low, high + 1, (), generator=generator))
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    requests = []
    for _ in range(args.prompts):
        prompt = tokens(20, 30)
        requests += [RewardRequest("", "", prompt, tokens(1, args.completion_tokens), {}) for _ in range(args.samples)]
    return requests


def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        score = reward_model(args.model, Path(tmp))
        vocab = score.load().config.vocab_size
        pools = {
            "batched": RewardPool(score, timeout_s=60.0),
            "one per call": RewardPool(OneAtATime(score), timeout_s=60.0),
        }
        seconds = {name: [] for name in pools}
        try:
            for pool in pools.values():  # start the workers (not timed) and check both score alike
                pool.score(step_requests(args, vocab, 0))
            first = [[o.value for o in pool.score(step_requests(args, vocab, 1))] for pool in pools.values()]
            assert max(abs(a - b) for a, b in zip(*first)) < 1e-4, "the two ways score differently"
            for step in range(args.steps):
                for name, pool in pools.items():
                    requests = step_requests(args, vocab, step + 2)
                    started = time.perf_counter()
                    outcomes = pool.score(requests)
                    seconds[name].append(time.perf_counter() - started)
                    assert all(o.error is None for o in outcomes), outcomes
        finally:
            for pool in pools.values():
                pool.close()
    per_step = {name: statistics.mean(s) for name, s in seconds.items()}
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "torch": torch.__version__,
        "model": str(args.model or "tiny critic"),
        "requests_per_step": args.prompts * args.samples,
        "completion_tokens": args.completion_tokens,
        "steps": args.steps,
        "s_per_step": per_step,
        "ratio_batched_over_one_per_call": per_step["batched"] / per_step["one per call"],
    }


def report(result: dict) -> str:
    s = result["s_per_step"]
    return "\n".join(
        [
            f"# reward model scoring ({result['date']})",
            "",
            f"machine: {result['machine']}; torch {result['torch']}; model {result['model']}; "
            f"{result['requests_per_step']} completions per step (1-{result['completion_tokens']} tokens), "
            f"{result['steps']} steps, one reward worker",
            "",
            "| scoring | s per step | per completion |",
            "|---|---|---|",
            *(f"| {name} | {t:.4f} | {1000 * t / result['requests_per_step']:.2f} ms |" for name, t in s.items()),
            "",
            f"batched / one per call: **{result['ratio_batched_over_one_per_call']:.3f}**",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a reward model folder (`areal-hpc rm`'s <run>/model)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=8)
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    run_and_record("reward_model_scoring", parser.parse_args(), run, report)


if __name__ == "__main__":
    main()
