"""The demo against a plain synchronous GRPO trainer (issue 13's peer measurement): time to accuracy on the
quickstart workload, from the same SFT warm-up, the same prompts in the same order, the same reward and
held-out evaluator, 16 prompts x 8 samples, lr 3e-4, in one run.

    .venv/bin/python bench/demo_vs_peer.py [--steps 200] [--sft-model DIR] [--save]

- peer (``PeerGRPO``, below): transformers ``generate()`` samples the 128 answers (temperature 1, no
  top-k/top-p, 8 new tokens), the task's reward scores them, advantages are normalised within each group,
  then one padded forward/backward with the token-mean PPO-clip loss (on-policy: ratio 1) and an AdamW
  step (the quickstart's optimizer settings), float32, torch on every core, all in this process.
- ours: ``python -m areal_hpc train --config configs/quickstart.yaml`` from the same model
  (``rl.sft_warmup_steps=0``): the asynchronous run exactly as ``make demo`` runs it.

Both evaluate greedily on the task's 200 held-out problems (``areal_hpc.train.evaluate``) at step 0,
every ``--eval-every`` steps and at the end. Training time excludes evaluations (the peer's clock stops
during them; ours' evaluation time, between a step's record and its evaluation's, is subtracted) and
start-up; s/step is that time over the steps. The median step (the peer's clock of a step, ours'
``time/step``) is less moved by other work on the machine: the peer's torch threads slow down many
times over when another process takes a core. The starting model is the quickstart's SFT warm-up (500
steps, 5-13 minutes on 2 cores) unless ``--sft-model`` gives one; 200 steps then take about 4.5 minutes.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from recording import machine, run_and_record  # noqa: E402

from areal_hpc.config import RunConfig, load_config  # noqa: E402
from areal_hpc.data.prompts import PromptStream  # noqa: E402
from areal_hpc.data.registry import build_task  # noqa: E402
from areal_hpc.data.rewards import RewardPool  # noqa: E402
from areal_hpc.fsio import read_json_lines  # noqa: E402
from areal_hpc.models.chat import prompt_ids  # noqa: E402
from areal_hpc.models.hf import load_model, load_tokenizer  # noqa: E402
from areal_hpc.train.evaluate import evaluate_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/quickstart.yaml"
SFT_STEPS = 500  # the quickstart's rl.sft_warmup_steps


class PeerGRPO:
    """Synchronous GRPO as a plain script writes it: generate, reward, normalise in groups, one step."""

    def __init__(self, model_dir: Path, cfg: RunConfig):
        self.model, self.tokenizer = load_model(model_dir), load_tokenizer(model_dir)
        self.task, self.cfg = build_task(cfg.dataset), cfg
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.actor.lr, betas=(opt.beta1, opt.beta2),
                                           eps=opt.eps, weight_decay=opt.weight_decay)

    @torch.no_grad()
    def generate(self, examples) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(sequences [n·k, W+L], their attention mask, W): k samples of each left-padded prompt."""
        tok, k = self.tokenizer, self.cfg.gconfig.n_samples
        prompts = [prompt_ids(tok, ex.prompt) for ex in examples]
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts]).repeat_interleave(k, 0)
        mask = (torch.arange(width)[None] >= width - torch.tensor([len(p) for p in prompts])[:, None]).long()
        mask = mask.repeat_interleave(k, 0)
        self.model.eval()
        out = self.model.generate(ids, attention_mask=mask, do_sample=True, temperature=self.cfg.gconfig.temperature,
                                  top_k=0, top_p=1.0, max_new_tokens=self.cfg.gconfig.max_new_tokens,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        answer = out[:, width:]
        eos = (answer == tok.eos_token_id).long()
        answer_mask = (eos.cumsum(1) - eos) == 0  # up to and including the first end-of-turn token
        return out, torch.cat([mask, answer_mask.long()], 1), width

    def step(self, examples) -> dict[str, float]:
        started = time.perf_counter()
        sequences, mask, width = self.generate(examples)
        answers = sequences[:, width:]
        answer_mask = mask[:, width:].bool()
        k = self.cfg.gconfig.n_samples
        texts = self.tokenizer.batch_decode(answers.masked_fill(~answer_mask, self.tokenizer.pad_token_id),
                                            skip_special_tokens=True)
        rewards = torch.tensor([self.task.reward(text, examples[i // k]) for i, text in enumerate(texts)]).view(-1, k)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, unbiased=False, keepdim=True) + 1e-6))
        generated = time.perf_counter()

        self.model.train()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = self.model(input_ids=sequences, attention_mask=mask, position_ids=positions).logits[:, width - 1:-1]
        logprobs = torch.log_softmax(logits.float() / self.cfg.gconfig.temperature, -1).gather(-1, answers[..., None])[..., 0]
        ratio = (logprobs - logprobs.detach()).exp()  # on-policy: 1, with the policy gradient
        eps, a = self.cfg.actor.eps_clip, advantages.view(-1, 1)
        token_loss = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
        loss = (token_loss * answer_mask).sum() / answer_mask.sum()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.gradient_clipping or float("inf"))
        self.optimizer.step()
        return {"generate_s": generated - started, "update_s": time.perf_counter() - generated,
                "reward": float(rewards.mean()), "tokens": int(mask.sum())}


def run_peer(model_dir: Path, cfg: RunConfig, steps: int, eval_every: int) -> dict:
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(cfg.experiment.seed)
    peer = PeerGRPO(model_dir, cfg)
    prompts = PromptStream(peer.task.train, cfg.experiment.seed)  # the order the rollout controller draws them in
    launched = time.perf_counter()
    clock, evals, steps_ = 0.0, [], []
    with RewardPool(peer.task.reward) as rewards:
        def evaluate(step: int) -> None:
            result = evaluate_model(peer.model, peer.tokenizer, peer.task.eval, rewards, cfg.gconfig.max_new_tokens)
            evals.append({"step": step, "train_s": clock, "accuracy": result.accuracy})

        evaluate(0)
        for step in range(1, steps + 1):
            started = time.perf_counter()
            steps_.append(peer.step([next(prompts) for _ in range(cfg.rollout.consumer_batch_size)]))
            steps_[-1]["step_s"] = time.perf_counter() - started
            clock += steps_[-1]["step_s"]
            if step == steps or step % eval_every == 0:
                evaluate(step)
    mean = {key: sum(s[key] for s in steps_) / len(steps_) for key in ("generate_s", "update_s")}
    return {"name": "peer: synchronous GRPO (generate(), padded step)", "train_s": clock,
            "process_s": time.perf_counter() - launched, "s_per_step": clock / steps,
            "median_s_per_step": statistics.median(s["step_s"] for s in steps_),
            "split": {"generate + reward": mean["generate_s"], "update": mean["update_s"]},
            "tokens_per_step": sum(s["tokens"] for s in steps_) / len(steps_), "evals": evals}


def run_ours(model_dir: Path, root: Path, steps: int, eval_every: int) -> dict:
    fileroot = root / "ours"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "areal_hpc", "train", "--config", CONFIG, f"model.path={model_dir}",
                    "rl.sft_warmup_steps=0", f"cluster.fileroot={fileroot}", f"rl.total_train_steps={steps}",
                    f"rl.eval_every_steps={eval_every}"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    process = time.perf_counter() - started
    records = read_json_lines(fileroot / "quickstart/trial0/metrics.jsonl")
    trained = {r["step"]: r for r in records if "rollout/reward" in r}
    evaluated = [r for r in records if "eval/accuracy" in r]
    start, evaluating, evals = evaluated[0]["time"], 0.0, []
    for e in evaluated:  # logged at its end; its step's record just before it started
        train_s = (trained[e["step"]]["time"] if e["step"] else start) - start - evaluating
        evals.append({"step": e["step"], "train_s": train_s, "accuracy": e["eval/accuracy"]})
        if e["step"]:
            evaluating += e["time"] - trained[e["step"]]["time"]
    rows = [trained[s] for s in sorted(trained)]
    split = {key: sum(r.get(key, 0.0) for r in rows) / len(rows)
             for key in ("time/generate_wait", "time/logprob", "time/update", "time/train", "sync/seconds",
                         "sync/stage_seconds", "time/step")}
    return {"name": "ours: asynchronous (areal-hpc train, quickstart)", "train_s": evals[-1]["train_s"],
            "process_s": process, "s_per_step": evals[-1]["train_s"] / steps, "split": split,
            "median_s_per_step": statistics.median(r["time/step"] for r in rows),
            "tokens_per_step": sum(r["train/tokens"] for r in rows) / len(rows), "evals": evals}


def sft_model(root: Path) -> Path:
    subprocess.run([sys.executable, "-m", "areal_hpc", "sft", "--config", CONFIG, f"cluster.fileroot={root / 'sft'}",
                    f"sft.total_train_steps={SFT_STEPS}"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return root / "sft" / "quickstart" / "trial0" / "model"


def time_to(evals: list[dict], accuracy: float) -> float | None:
    """Training seconds at the first evaluation reaching ``accuracy``."""
    return next((e["train_s"] for e in evals if e["accuracy"] >= accuracy - 1e-9), None)


def standard_error(accuracy: float, n: int) -> float:
    """Binomial standard error of an accuracy measured on ``n`` held-out problems."""
    return (accuracy * (1 - accuracy) / n) ** 0.5


def run(args) -> dict:
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="demo_vs_peer-") as tmp:
        model = Path(args.sft_model) if args.sft_model else sft_model(Path(tmp))
        cfg = load_config(CONFIG, [f"model.path={model}"])
        peer = run_peer(model, cfg, args.steps, args.eval_every)
        load.append(os.getloadavg()[0])
        ours = run_ours(model, Path(tmp), args.steps, args.eval_every)
        load.append(os.getloadavg()[0])
    target = peer["evals"][-1]["accuracy"]
    for row in (peer, ours):
        row["best"] = max(e["accuracy"] for e in row["evals"])
        row["time_to_peer_final"] = time_to(row["evals"], target)
    reached = ours["time_to_peer_final"]
    return {"benchmark": "demo_vs_peer", "date": date.today().isoformat(), "machine": machine(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "steps": args.steps, "eval_every": args.eval_every, "model": args.sft_model or f"SFT {SFT_STEPS} steps",
            "eval_problems": cfg.dataset.eval_size, "load_average_1min": load, "peer": peer, "ours": ours, "peer_final_accuracy": target,
            "s_per_step_ratio": ours["s_per_step"] / peer["s_per_step"],
            "median_s_per_step_ratio": ours["median_s_per_step"] / peer["median_s_per_step"],
            "time_to_peer_final_ratio": None if reached is None else reached / peer["train_s"],
            "goals": {"ours <= 0.14 s/step": ours["s_per_step"] <= 0.14,
                      "peer's final accuracy in <= half the peer's time": reached is not None
                      and reached <= 0.5 * peer["train_s"]}}


def report(r: dict) -> str:
    peer, ours = r["peer"], r["ours"]
    lines = [f"# Demo vs a plain synchronous GRPO peer ({r['date']})", "",
             f"Machine: {r['machine']}; 1-minute load average at start, after the peer, after ours: "
             f"{', '.join(f'{x:.2f}' for x in r['load_average_1min'])}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + ".",
             f"{r['steps']} steps of 16 prompts x 8 samples from {r['model']}, evaluated on {r['eval_problems']} held-out problems "
             f"every {r['eval_every']} steps; training seconds exclude evaluations and start-up.", "",
             "| trainer | train s | s/step | median s/step | split per step (s, means) | tokens/step | process s | accuracy at step 0 -> end | best | "
             "s to the peer's final accuracy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in (peer, ours):
        split = ", ".join(f"{k} {v:.3f}" for k, v in row["split"].items())
        reached = row["time_to_peer_final"]
        lines.append(f"| {row['name']} | {row['train_s']:.1f} | {row['s_per_step']:.3f} | "
                     f"{row['median_s_per_step']:.3f} | {split} | "
                     f"{row['tokens_per_step']:.0f} | {row['process_s']:.1f} | {row['evals'][0]['accuracy']:.1%} -> "
                     f"{row['evals'][-1]['accuracy']:.1%} | {row['best']:.1%} | "
                     f"{'not reached' if reached is None else f'{reached:.1f}'} |")
    lines += ["", "| step | " + " | ".join(str(e["step"]) for e in peer["evals"]) + " |",
              "|---" * (len(peer["evals"]) + 1) + "|"]
    for row in (peer, ours):
        lines.append(f"| {row['name'].split(':')[0]} accuracy | " + " | ".join(f"{e['accuracy']:.1%}" for e in row["evals"])
                     + " |")
        lines.append(f"| {row['name'].split(':')[0]} train s | " + " | ".join(f"{e['train_s']:.1f}" for e in row["evals"])
                     + " |")
    ratio = r["time_to_peer_final_ratio"]
    lines += ["", f"s/step ours/peer: **{r['s_per_step_ratio']:.2f}x** (medians: {r['median_s_per_step_ratio']:.2f}x); ours' time to the peer's final accuracy "
              f"({r['peer_final_accuracy']:.1%}) / the peer's {r['steps']}-step time: "
              f"**{'not reached' if ratio is None else f'{ratio:.2f}x'}** (goal <= 0.5). One evaluation's standard error "
              f"at that accuracy: {100 * standard_error(r['peer_final_accuracy'], r['eval_problems']):.1f} points.",
              "Goals: " + "; ".join(f"{k}: {'met' if v else 'not met'}" for k, v in r["goals"].items()) + "."]
    return "\n".join(lines)


def plot(r: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for row in (r["peer"], r["ours"]):
        ax.plot([e["train_s"] for e in row["evals"]], [100 * e["accuracy"] for e in row["evals"]], marker="o",
                label=f"{row['name']} ({row['s_per_step']:.3f} s/step)")
    ax.axhline(100 * r["peer_final_accuracy"], color="grey", lw=0.8, ls="--", label="peer's final accuracy")
    ax.set_xlabel("training seconds (evaluations excluded)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(f"time to accuracy, quickstart, {r['steps']} steps ({r['date']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of each trainer")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    parser.add_argument("--sft-model", default="", help=f"starting model (default: a fresh {SFT_STEPS}-step SFT warm-up)")
    parser.add_argument("--save", action="store_true", help="record the result (and its plot) in bench/results/")
    arguments = parser.parse_args()
    run_and_record("demo_vs_peer", arguments, run, report, plot)
