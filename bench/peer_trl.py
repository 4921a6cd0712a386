"""The quickstart's asynchronous GRPO against Hugging Face TRL's ``GRPOTrainer`` on the same task: the
same starting model, prompts in the same order, reward, held-out evaluator and optimizer, N steps of 16
prompts x 8 samples each, one run at a time, seeds alternating ours / TRL.

    .venv/bin/python bench/peer_trl.py [--steps 200] [--seeds 1 2 3] [--start-model DIR] [--save]
    .venv/bin/python bench/peer_trl.py --quick          # 10 steps, 1 seed: does it work

TRL is a bench-only extra: ``.venv/bin/pip install -c constraints/cpu.txt -e '.[peer]'``.

- ours: ``python -m areal_hpc train --config configs/quickstart.yaml`` from the starting model
  (``rl.sft_warmup_steps=0``), as ``make demo`` runs it (rollout server and trainer on their own cores,
  staleness bound 2, interruptible generation); no checkpoints but the final one, no TensorBoard.
- TRL: ``GRPOTrainer`` in a child process (``--trl-child``), on the same model folder loaded by the project's
  own ``load_model``, fed a ``datasets.Dataset`` of exactly the prompts ``PromptStream`` draws for that seed,
  in that order (``shuffle_dataset=False``); every batch ``generate()`` receives is checked token for token
  against the project's rendering of those prompts (``example_prompt_ids``), 8 rows each. One generation and
  one optimizer step per 16 prompts (``per_device_train_batch_size=128``, ``num_iterations=1``); the
  project's reward pool as the reward function; the project's AdamW (weight decay on matrices only) and
  warm-up schedule passed in as ``optimizers=``; the quickstart's clip, eps, temperature, top-p/top-k,
  max_new_tokens, KL coefficient (0) and bfloat16 compute; token-mean loss (``loss_type="dapo"``),
  group-normalised advantages (``scale_rewards="group"``). A ``TrainerCallback`` evaluates the model in
  memory with ``areal_hpc.train.evaluate.evaluate_model`` (greedy, the quickstart's held-out problems) at step 0,
  every ``rl.eval_every_steps`` and at the end, and writes the run's metrics.jsonl as ours does.

Both: s/step is the mean of the steps after the first ``SKIP_STEPS``, evaluations excluded: TRL's step
from one step's end to the next, less its evaluation (which runs between steps); ours the driver's
``time/step`` of the steps no evaluation ran beside (ours evaluates on the rollout server while training
goes on: ``eval/seconds`` before its record). Beside it, over every step (``s_per_step_all``, ours less
``time/eval_wait``, what a step waited for an evaluation to end; the steps an evaluation ran beside are
slower: it shares the server's core and rank 0's interpreter); final accuracy is the mean of the last
``LAST_EVALS`` evaluations; memory is the PSS of the whole process tree (the process and every descendant,
from /proc/<pid>/smaps_rollup) every ``SAMPLE_S`` seconds: the peak, and the median of the second half
of the run (steady state); and the cores the run used and those the rest of the machine used meanwhile.
TRL runs with torch's threads (every core) unless ``--trl-threads`` says otherwise: on a busy machine
they spin against other work (on 2 cores kept busy by others, one ``generate()`` of the 128 answers took
0.4-0.7 s with one thread and 7-12 s with two), so read s/step beside the other-load column.
What cannot be made equal (TRL has no knob for it): TRL is synchronous and on-policy by default, ours trains
batches up to 2 versions stale (the point of the comparison; through PPO's own ratio and clip against the
sampler, as TRL's would be with ``--trl-steps-per-generation`` above 1); TRL divides advantages
by the Bessel-corrected group std + 1e-4, ours by the population std + 1e-6 (a constant factor sqrt(8/7)
that AdamW's normalisation all but cancels); TRL's ``generate()`` runs under the same bfloat16 autocast as
its training, ours samples in float32 on the rollout server; ours' batches are the first 16 groups to
finish of the prompts drawn in that order, TRL's exactly the next 16.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import date
from pathlib import Path

import scipy.stats
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from async_vs_sync import cpu_seconds  # noqa: E402
from recording import RESULTS, machine, machine_and_versions, record_name, save  # noqa: E402
from run_processes import process_tree, pss_mib  # noqa: E402

from areal_hpc.config import load_config  # noqa: E402
from areal_hpc.errors import UserError  # noqa: E402
from areal_hpc.fsio import read_json_lines  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/quickstart.yaml"
INSTALL = "TRL is not installed: .venv/bin/pip install -c constraints/cpu.txt -e '.[peer]'"
SKIP_STEPS = 3  # steps left out of s/step: start-up, the servers' first episodes, allocator warm-up
LAST_EVALS = 3  # evaluations averaged into the final accuracy
SAMPLE_S = 0.5  # seconds between memory samples
RUN_FILE = "quickstart/trial0/metrics.jsonl"  # under a run's fileroot, for both sides


class TreeMemory:
    """PSS of a process tree, sampled every SAMPLE_S seconds in a thread until ``stop``."""

    def __init__(self, root: int):
        self.root, self.samples = root, []  # (seconds since start, MiB)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._started = time.monotonic()
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.is_set():
            self.samples.append((time.monotonic() - self._started, sum(map(pss_mib, process_tree(self.root)))))
            self._done.wait(SAMPLE_S)

    def stop(self) -> dict:
        self._done.set()
        self._thread.join()
        values = [mib for _, mib in self.samples]
        half = self.samples[-1][0] / 2
        return {"peak_mib": max(values), "steady_mib": statistics.median(m for t, m in self.samples if t >= half),
                "samples": len(values)}


def run_tracked(console: Console, label: str, command: list[str], metrics: Path, steps: int, log: Path,
                env: dict | None = None) -> dict:
    """Run ``command`` (output to ``log``), sampling its process tree's memory and showing the steps its
    metrics file records; the memory figures, the wall seconds, the cores the run used and those the rest
    of the machine (other people's work) used meanwhile."""
    (busy, children), started = cpu_seconds(), time.perf_counter()
    with log.open("w") as out, console.status(f"{label}: starting") as status:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        memory = TreeMemory(process.pid)
        while process.poll() is None:
            done = sum("time/step" in r for r in read_json_lines(metrics))
            status.update(f"{label}: step {done}/{steps}, {time.perf_counter() - started:.0f} s, "
                          f"{memory.samples[-1][1] if memory.samples else 0:.0f} MiB")
            time.sleep(1.0)
        result = memory.stop()
    (busy_end, children_end), wall = cpu_seconds(), time.perf_counter() - started
    if process.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{label} exited with {process.returncode} (log {log}):\n{tail}")
    used = children_end - children  # CPU seconds of the run's processes (each waited for by its parent)
    return result | {"wall_s": wall, "cores_used": used / wall, "other_load": max(0.0, (busy_end - busy - used) / wall)}


def curve(metrics: Path) -> dict:
    """s/step, the evaluation curve and the final accuracy from a run's metrics.jsonl (either side)."""
    records = read_json_lines(metrics)
    steps = sorted((r for r in records if "time/step" in r), key=lambda r: r["step"])
    steps = steps[SKIP_STEPS:] or steps
    seconds = [r["time/step"] - r.get("time/eval_wait", 0.0) for r in steps]  # ours: waited for an evaluation
    # ours evaluates beside training (``eval/seconds`` before its record's time); TRL between steps
    windows = [(r["time"] - r["eval/seconds"], r["time"]) for r in records if "eval/seconds" in r]
    alone = [s for r, s in zip(steps, seconds)
             if not any(r["time"] - r["time/step"] < end and r["time"] > begin for begin, end in windows)]
    evals = [{"step": r["step"], "accuracy": r["eval/accuracy"]} for r in records if "eval/accuracy" in r]
    return {"steps": len(steps), "s_per_step": statistics.fmean(alone), "median_s_per_step": statistics.median(alone),
            "s_per_step_all": statistics.fmean(seconds), "median_s_per_step_all": statistics.median(seconds),
            "steps_beside_evaluations": len(seconds) - len(alone),
            "final_accuracy": statistics.fmean(e["accuracy"] for e in evals[-LAST_EVALS:]), "evals": evals,
            "mean_reward": statistics.fmean(r["rollout/reward"] for r in records if "rollout/reward" in r)}


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def run_ours(console: Console, root: Path, model: Path, seed: int, steps: int, eval_every: int,
             extra: list[str]) -> dict:
    fileroot = fresh(root / f"ours-seed{seed}")
    command = [sys.executable, "-m", "areal_hpc", "train", "--config", CONFIG,
               *run_overrides(model, seed, steps, eval_every, extra), f"cluster.fileroot={fileroot}",
               "saver.freq_steps=0", "stats.tensorboard=false", "stats.plot=false"]
    tracked = run_tracked(console, f"ours, seed {seed}", command, fileroot / RUN_FILE, steps, fileroot / "log.txt")
    return {"trainer": "ours", "seed": seed} | curve(fileroot / RUN_FILE) | tracked


def run_trl(console: Console, root: Path, model: Path, seed: int, steps: int, eval_every: int,
            extra: list[str], threads: int, steps_per_generation: int) -> dict:
    fileroot = fresh(root / f"trl-seed{seed}")
    command = [sys.executable, str(Path(__file__).resolve()), "--trl-child", str(fileroot), "--start-model",
               str(model), "--seeds", str(seed), "--steps", str(steps), "--eval-every", str(eval_every),
               "--trl-steps-per-generation", str(steps_per_generation), *(f"--set={kv}" for kv in extra)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None  # as ours sets its processes'
    tracked = run_tracked(console, f"TRL, seed {seed}", command, fileroot / RUN_FILE, steps, fileroot / "log.txt", env)
    return {"trainer": "trl", "seed": seed} | curve(fileroot / RUN_FILE) | tracked


def trl_child(fileroot: Path, model_dir: Path, seed: int, steps: int, eval_every: int, extra: list[str],
              steps_per_generation: int) -> None:
    """GRPOTrainer on the quickstart task (see the module docstring); writes ``fileroot/RUN_FILE``."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from areal_hpc.agents.engine import Sampling
    from areal_hpc.agents.registry import build_workflow
    from areal_hpc.data.prompts import PromptStream
    from areal_hpc.data.rewards import RewardRequest
    from areal_hpc.engines.optim import build_optimizer, build_scheduler
    from areal_hpc.models.chat import example_prompt_ids
    from areal_hpc.models.hf import load_model, load_tokenizer
    from areal_hpc.parallel.device import resolve_device
    from areal_hpc.train.evaluate import evaluate_model
    from areal_hpc.train.metrics import MetricsLogger
    from areal_hpc.train.task_setup import open_task, reward_pool

    cfg = load_config(CONFIG, run_overrides(model_dir, seed, steps, eval_every, extra))
    if unmatched := trl_cannot_follow(cfg):
        raise SystemExit(f"{CONFIG} sets what this mapping onto GRPOConfig does not carry: {', '.join(unmatched)}")
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, cfg.model.dtype, cfg.model.attn_impl)
    task = open_task(cfg, tokenizer, model_dir)
    k, per_step = cfg.gconfig.n_samples, cfg.rollout.consumer_batch_size
    stream = PromptStream(task.train, cfg.experiment.seed)
    # TRL draws whole generations of ``steps_per_generation`` steps: the last may reach past the steps it trains
    generated_steps = math.ceil(steps / steps_per_generation) * steps_per_generation
    order = [next(stream) for _ in range(generated_steps * per_step)]  # the order ours' rollout controller draws
    examples = {ex.uid: ex for ex in order}
    rendered = {ex.uid: example_prompt_ids(tokenizer, ex) for ex in order}  # once per prompt, as ours caches them
    dataset = Dataset.from_dict({"prompt": [list(ex.messages) or [{"role": "user", "content": ex.prompt}]
                                            for ex in order], "uid": [ex.uid for ex in order]})
    metrics = MetricsLogger(fileroot / RUN_FILE.rsplit("/", 1)[0], tensorboard=False)
    rewards = reward_pool(cfg, task)
    last_rewards: list[float] = []

    def project_reward(prompts, completions, completion_ids, uid, **_) -> list[float]:
        """The task's reward through the project's reward pool, called as ours' workflow calls it."""
        requests = []
        for ids, name in zip(completion_ids, uid):
            prompt = rendered[name]
            requests.append(RewardRequest(tokenizer.decode(prompt, skip_special_tokens=False),
                                          tokenizer.decode(ids, skip_special_tokens=True), prompt, list(ids),
                                          examples[name].reward_fields()))
        last_rewards[:] = [outcome.value for outcome in rewards.score(requests)]
        return list(last_rewards)

    checked = PromptCheck(model, [rendered[ex.uid] for ex in order], k)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.actor.lr)
    gen = cfg.gconfig
    args = GRPOConfig(
        output_dir=str(fileroot / "trl"), seed=seed, max_steps=steps, per_device_train_batch_size=per_step * k,
        gradient_accumulation_steps=1, num_generations=k, steps_per_generation=steps_per_generation,
        num_iterations=1,
        shuffle_dataset=False, max_completion_length=gen.max_new_tokens, temperature=gen.temperature,
        top_p=gen.top_p, top_k=max(0, gen.top_k), learning_rate=cfg.actor.lr,
        max_grad_norm=cfg.optimizer.gradient_clipping, beta=cfg.actor.kl_ctl, epsilon=cfg.actor.eps_clip,
        epsilon_high=cfg.actor.eps_clip_high or cfg.actor.eps_clip, loss_type="dapo", scale_rewards="group",
        importance_sampling_level=cfg.actor.importance_level, bf16=cfg.model.compute_dtype == "bfloat16",
        **{checkpointing_field(GRPOConfig): False}, use_cpu=resolve_device(cfg.cluster.device).type == "cpu",
        save_strategy="no", report_to="none", disable_tqdm=True)

    def evaluate(step: int) -> None:
        result = evaluate_model(model, tokenizer, task.eval, rewards, Sampling.from_config(cfg.gconfig),
                                build_workflow(cfg.rollout), model_dir, discount=cfg.rollout.turn_discount)
        metrics.log(step, result.scalars())

    class EvaluateAndClock(TrainerCallback):
        """Our evaluator at step 0, every ``eval_every`` steps and at the end; each step's seconds
        (from the previous step's end, evaluations excluded) and mean reward, in ours' metric names."""

        def on_train_begin(self, args, state, control, **kwargs):
            evaluate(0)
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            metrics.log(step, {"time/step": time.perf_counter() - self.mark,
                               "rollout/reward": sum(last_rewards) / len(last_rewards)})
            if step == steps or (eval_every and step % eval_every == 0):
                evaluate(step)
            self.mark = time.perf_counter()

    trainer = GRPOTrainer(model=model, reward_funcs=project_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[EvaluateAndClock()],
                          optimizers=(optimizer, build_scheduler(optimizer, cfg.optimizer, steps)))
    try:
        trainer.train()
    finally:
        rewards.close()
        metrics.close()
    if checked.rows != generated_steps * per_step * k:
        raise SystemExit(f"TRL generated {checked.rows} rows, expected {generated_steps * per_step * k}: the prompt check did not "
                         f"see every batch")


def checkpointing_field(config_class) -> str:
    """TRL's GRPOConfig checkpoints activations unless told not to; transformers 5.24 names that field
    ``activation_checkpointing``, 5.17 ``gradient_checkpointing``."""
    fields = config_class.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


class PromptCheck:
    """Wraps ``model.generate``: every batch TRL generates from must be the next prompts of the stream,
    each ``k`` times in a row, token for token as the project renders them (left padding stripped)."""

    def __init__(self, model, rendered: list[list[int]], k: int):
        self.generate, self.rendered, self.k, self.rows = model.generate, rendered, k, 0
        model.generate = self

    def __call__(self, input_ids, attention_mask, **kwargs):
        for ids, mask in zip(input_ids, attention_mask):
            got, want = ids[mask.bool()].tolist(), self.rendered[self.rows // self.k]
            if got != want:
                raise SystemExit(f"TRL's prompt row {self.rows} is {got}, the project renders {want}")
            self.rows += 1
        return self.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def trl_cannot_follow(cfg) -> list[str]:
    """Settings of the run that ``trl_child`` does not translate into GRPOConfig (the quickstart sets none)."""
    actor, gen = cfg.actor, cfg.gconfig
    checks = {"actor.adv_estimator": actor.adv_estimator == "grpo",
              "actor.aggregation": actor.aggregation == "token-mean",
              "actor.ppo_n_minibatches": actor.ppo_n_minibatches == 1,
              "actor.dynamic_sampling": not actor.dynamic_sampling,
              "actor.overlong_cache_tokens": actor.overlong_cache_tokens == 0, "gconfig.greedy": not gen.greedy,
              "rollout.workflow": cfg.rollout.workflow in ("", "rlvr")}
    return [key for key, holds in checks.items() if not holds]


def run_overrides(model_dir: Path, seed: int, steps: int, eval_every: int, extra: list[str]) -> list[str]:
    """The quickstart as both sides run it here (with ``--set``'s ``extra`` overrides): ours on its command
    line, TRL reads its knobs from it."""
    return [f"model.path={model_dir}", "rl.sft_warmup_steps=0", f"rl.total_train_steps={steps}",
            f"rl.eval_every_steps={eval_every}", f"experiment.seed={seed}", *extra]


def start_model(console: Console, root: Path, sft_steps: int) -> Path:
    """The quickstart's SFT warm-up (what ``areal-hpc train`` runs before RL), written under ``root``."""
    fileroot = fresh(root / f"sft-{sft_steps}")
    with console.status(f"SFT warm-up, {sft_steps} steps"):
        subprocess.run([sys.executable, "-m", "areal_hpc", "sft", "--config", CONFIG, f"cluster.fileroot={fileroot}",
                        f"sft.total_train_steps={sft_steps}", "saver.freq_steps=0", "stats.tensorboard=false",
                        "stats.plot=false"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return fileroot / "quickstart" / "trial0" / "model"


def run_table(row: dict) -> Table:
    table = Table(title=f"{row['trainer']}, seed {row['seed']}: {row['steps']} steps", show_header=False)
    for name, value in (
            ("s/step (mean, median)", f"{row['s_per_step']:.3f}, {row['median_s_per_step']:.3f}"),
            ("s/step, every step (mean, median)", f"{row['s_per_step_all']:.3f}, {row['median_s_per_step_all']:.3f} "
                                                  f"({row['steps_beside_evaluations']} beside an evaluation)"),
            ("final accuracy", f"{row['final_accuracy']:.1%}"),
            ("accuracy by step", " ".join(f"{e['step']}: {e['accuracy']:.1%}" for e in row["evals"])),
            ("mean training reward", f"{row['mean_reward']:.3f}"),
            ("PSS of the process tree (peak, steady)", f"{row['peak_mib']:.0f}, {row['steady_mib']:.0f} MiB"),
            ("wall s, cores used, other load (cores)",
             f"{row['wall_s']:.0f}, {row['cores_used']:.2f}, {row['other_load']:.2f}")):
        table.add_row(name, value)
    return table


def run(args, console: Console) -> dict:
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(CONFIG)
    sft_steps = args.sft_steps or cfg.rl.sft_warmup_steps
    model = Path(args.start_model).resolve() if args.start_model else start_model(console, root, sft_steps)
    console.print(f"starting model: {model} (reuse it with --start-model {model})", soft_wrap=True)
    eval_every = args.eval_every if args.eval_every is not None else cfg.rl.eval_every_steps
    settings = {"machine": machine(), "steps": args.steps, "eval_every": eval_every,
                "start_model": args.start_model or f"SFT warm-up, {sft_steps} steps",
                "versions": {"python": platform.python_version(),
                             **{name: importlib.metadata.version(name) for name in ("torch", "trl", "transformers")}}}
    if args.set:  # recorded (and matched when pooling) only where set: earlier records have neither key
        settings["overrides"] = args.set
    if args.trl_steps_per_generation != 1:
        settings["trl_steps_per_generation"] = args.trl_steps_per_generation
    earlier = pooled_rows(args.pool_with, settings, args.seeds)
    rows = []
    for seed in args.seeds:
        rows.append(run_ours(console, root, model, seed, args.steps, eval_every, args.set))
        console.print(run_table(rows[-1]))
        rows.append(run_trl(console, root, model, seed, args.steps, eval_every, args.set, args.trl_threads,
                            args.trl_steps_per_generation))
        console.print(run_table(rows[-1]))
    rows = earlier + rows
    ours, trl = ([r for r in rows if r["trainer"] == name] for name in ("ours", "trl"))
    mean = lambda side, key: statistics.fmean(r[key] for r in side)  # noqa: E731
    return {"benchmark": "peer_trl", "date": date.today().isoformat(), **settings,
            "seeds": sorted({r["seed"] for r in rows}), "pooled_with": [str(path) for path in args.pool_with],
            "trl_threads": args.trl_threads or f"torch's default ({os.cpu_count()}, every core)",
            "skip_steps": SKIP_STEPS, "last_evals": LAST_EVALS, "rows": rows,
            "accuracy_paired": paired_difference(ours, trl),
            "s_per_step_ratio": mean(ours, "s_per_step") / mean(trl, "s_per_step"),
            "s_per_step_ratio_all_steps": mean(ours, "s_per_step_all") / mean(trl, "s_per_step_all"),
            "accuracy_ours_minus_trl": mean(ours, "final_accuracy") - mean(trl, "final_accuracy"),
            "peak_pss_ratio": mean(ours, "peak_mib") / mean(trl, "peak_mib"),
            "steady_pss_ratio": mean(ours, "steady_mib") / mean(trl, "steady_mib")}


def pooled_rows(records: list[Path], settings: dict, seeds: list[int]) -> list[dict]:
    """The runs of earlier records of this benchmark (``--pool-with``), made under the same ``settings`` (machine,
    versions, steps, evaluation interval, starting model) and on other seeds; anything else is refused (exit 2)
    before a run starts."""
    rows: list[dict] = []
    for path in records:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            refuse(f"--pool-with {path}: not a readable JSON record of this benchmark ({error})")
        if not isinstance(record, dict) or record.get("benchmark") != "peer_trl" or not isinstance(record.get("rows"), list):
            refuse(f"--pool-with {path}: not a record of peer_trl (a bench/results/peer_trl-*.json)")
        for key, value in settings.items():
            if record.get(key) != value:
                refuse(f"--pool-with {path}: its {key} is {record.get(key)!r}, this run's {value!r}; "
                       "only records made under the same settings pool")
        rows += record["rows"]
    runs = Counter([(r["trainer"], r["seed"]) for r in rows] + [(side, seed) for seed in seeds for side in ("ours", "trl")])
    repeated = sorted({seed for (_, seed), count in runs.items() if count > 1})
    if repeated:
        refuse(f"--pool-with: seeds {repeated} would count twice (in two records, or in a record and this run); "
               "pool records of other seeds and run other seeds")
    return rows


def paired_difference(ours: list[dict], trl: list[dict]) -> dict:
    """Final accuracy, ours minus TRL's, seed by seed (the two sides of a seed see the same prompts): the mean,
    its standard error and a 95% interval (Student's t over the seeds)."""
    trl_final = {r["seed"]: r["final_accuracy"] for r in trl}
    differences = [r["final_accuracy"] - trl_final[r["seed"]] for r in ours if r["seed"] in trl_final]
    if len(differences) < 2:
        return {"seeds": len(differences), "mean": statistics.fmean(differences) if differences else None}
    mean, error = statistics.fmean(differences), statistics.stdev(differences) / math.sqrt(len(differences))
    half = scipy.stats.t.ppf(0.975, len(differences) - 1) * error
    return {"seeds": len(differences), "mean": mean, "standard_error": error,
            "ci95": [float(mean - half), float(mean + half)]}


def refuse(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def paired_text(paired: dict) -> str:
    if "ci95" not in paired:
        return f"Seed by seed (ours minus TRL's final accuracy): {paired['seeds']} seed(s), no interval."
    low, high = paired["ci95"]
    return (f"Seed by seed (ours minus TRL's final accuracy, {paired['seeds']} seeds): mean "
            f"{100 * paired['mean']:+.2f} points, standard error {100 * paired['standard_error']:.2f}, 95% interval "
            f"{100 * low:+.2f} to {100 * high:+.2f} points.")


def summary_table(result: dict) -> Table:
    table = Table(title=f"peer_trl: ours / TRL over seeds {result['seeds']}, {result['steps']} steps")
    for name in ("s/step ratio", "every step", "accuracy ours - TRL", "95% interval", "PSS peak ratio",
                 "PSS steady ratio"):
        table.add_column(name)
    interval = result["accuracy_paired"].get("ci95")
    table.add_row(f"{result['s_per_step_ratio']:.2f}x", f"{result['s_per_step_ratio_all_steps']:.2f}x",
                  f"{100 * result['accuracy_ours_minus_trl']:+.1f} points",
                  "-" if interval is None else f"{100 * interval[0]:+.1f} to {100 * interval[1]:+.1f}",
                  f"{result['peak_pss_ratio']:.2f}x", f"{result['steady_pss_ratio']:.2f}x")
    return table


def report(r: dict) -> str:
    lines = [f"# ours vs TRL GRPOTrainer on the quickstart ({r['date']})", "",
             machine_and_versions(r),
             f"{r['steps']} steps of 16 prompts x 8 samples from {r['start_model']}, seeds {r['seeds']}, evaluated "
             f"greedily on the {load_config(CONFIG, []).dataset.eval_size} held-out problems every {r['eval_every']} steps; s/step over the steps after the "
             f"first {r['skip_steps']} with evaluations excluded (TRL: its evaluations' time, between steps; ours: the "
             "steps an evaluation ran beside; 'every step': ours less only what a step waited for one), final accuracy the "
             f"mean of the last {r['last_evals']} evaluations, memory the PSS of each run's process tree.", "",
             f"TRL's torch threads: {r['trl_threads']}; ours: the quickstart's launcher (rollout server and trainer "
             "pinned to their own cores).", "",
             f"Overrides on both sides: {' '.join(r.get('overrides', [])) or 'none'}; TRL generates every "
             f"{r.get('trl_steps_per_generation', 1)} optimizer step(s).", "",
             "| trainer | seed | s/step | median s/step | every step: s/step, median (beside an evaluation) | "
             "final accuracy | accuracy by step | mean reward | "
             "PSS peak (MiB) | PSS steady (MiB) | wall s | cores used | other load (cores) |", "|---" * 13 + "|"]
    for row in r["rows"]:
        lines.append(f"| {row['trainer']} | {row['seed']} | {row['s_per_step']:.3f} | {row['median_s_per_step']:.3f} | "
                     f"{row['s_per_step_all']:.3f}, {row['median_s_per_step_all']:.3f} ({row['steps_beside_evaluations']}) | "
                     f"{row['final_accuracy']:.1%} | "
                     + " ".join(f"{e['step']}: {e['accuracy']:.1%}" for e in row["evals"])
                     + f" | {row['mean_reward']:.3f} | {row['peak_mib']:.0f} | {row['steady_mib']:.0f} | "
                     f"{row['wall_s']:.0f} | {row['cores_used']:.2f} | {row['other_load']:.2f} |")
    lines += ["", f"s_per_step_ratio (ours / TRL, mean s/step, evaluations excluded): **{r['s_per_step_ratio']:.2f}x** "
              f"(over every step: {r['s_per_step_ratio_all_steps']:.2f}x); "
              f"accuracy_ours_minus_trl (mean final accuracy): **{r['accuracy_ours_minus_trl']:+.3f}**; "
              f"PSS ours / TRL: peak {r['peak_pss_ratio']:.2f}x, steady {r['steady_pss_ratio']:.2f}x.",
              paired_text(r["accuracy_paired"]),
              "Accuracy at step 0 (the same model and evaluator on both sides: ours through its rollout server, TRL's "
              "in memory; they should agree): "
              + ", ".join(f"{row['trainer']} seed {row['seed']} {row['evals'][0]['accuracy']:.1%}" for row in r["rows"])
              + "."]
    return "\n".join(lines)


def plot(result: dict, out: Path) -> None:
    """Held-out accuracy by step (each seed faint, the mean over seeds bold) and each run's s/step, ours
    beside TRL's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, speed) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    for trainer, colour in (("ours", "tab:blue"), ("trl", "tab:orange")):
        rows = [r for r in result["rows"] if r["trainer"] == trainer]
        label = "ours" if trainer == "ours" else "TRL GRPOTrainer"
        for row in rows:
            curves.plot([e["step"] for e in row["evals"]], [e["accuracy"] for e in row["evals"]], color=colour,
                        alpha=0.2, linewidth=0.8)
        steps = [e["step"] for e in rows[0]["evals"]]
        mean = [statistics.fmean(r["evals"][i]["accuracy"] for r in rows) for i in range(len(steps))]
        final = statistics.fmean(r["final_accuracy"] for r in rows)
        curves.plot(steps, mean, color=colour, linewidth=2, marker="o", markersize=3,
                    label=f"{label}: last {result['last_evals']} evaluations {final:.1%}")
        speed.scatter([r["seed"] for r in rows], [r["s_per_step"] for r in rows], color=colour,
                      label=f"{label}: {statistics.fmean(r['s_per_step'] for r in rows):.3f} s mean")
    curves.set_xlabel("RL step")
    curves.set_ylabel("held-out accuracy (greedy)")
    curves.grid(alpha=0.3)
    curves.legend(loc="lower right")
    speed.set_xlabel("seed")
    speed.set_ylabel("s/step (evaluations excluded)")
    speed.set_ylim(bottom=0)
    speed.grid(alpha=0.3)
    speed.legend(loc="lower right")
    fig.suptitle(f"ours vs TRL on the quickstart ({result['date']}): {result['s_per_step_ratio']:.2f}x the time "
                 f"per step, {100 * result['accuracy_ours_minus_trl']:+.1f} points")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="RL steps of every run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds, each run by ours then TRL")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between evaluations "
                        "(default: the quickstart's rl.eval_every_steps)")
    parser.add_argument("--start-model", default="", help="starting model folder (default: a fresh SFT warm-up)")
    parser.add_argument("--sft-steps", type=int, default=0,
                        help="steps of that warm-up (default: the quickstart's rl.sft_warmup_steps)")
    parser.add_argument("--trl-threads", type=int, default=0,
                        help="OMP_NUM_THREADS of the TRL process (default: torch's, every core)")
    parser.add_argument("--root", default="runs/bench/peer_trl", help="folder of the runs (and of the warm-up)")
    parser.add_argument("--quick", action="store_true", help="a check that it works: 10 steps, 1 seed, eval every 5")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    parser.add_argument("--label", default="", help="results file peer_trl-LABEL-<date>")
    parser.add_argument("--pool-with", type=Path, nargs="+", default=[], metavar="RECORD.json",
                        help="earlier records of this benchmark (same machine, versions, steps, evaluations and start "
                             "model; other seeds) whose runs the summary counts beside this run's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for both sides (repeatable; TRL refuses what it cannot follow)")
    parser.add_argument("--trl-steps-per-generation", type=int, default=1, metavar="K",
                        help="TRL generates once every K optimizer steps, so its j-th step of each K trains on "
                             "answers j versions old, importance-weighted by its PPO ratio (1: on-policy)")
    parser.add_argument("--trl-child", metavar="DIR", help=argparse.SUPPRESS)  # the TRL run, in its own process
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        refuse(INSTALL)
    if args.trl_child:
        trl_child(Path(args.trl_child), Path(args.start_model), args.seeds[0], args.steps, args.eval_every, args.set,
                  args.trl_steps_per_generation)
        return
    if args.trl_steps_per_generation < 1:
        refuse(f"--trl-steps-per-generation {args.trl_steps_per_generation}: TRL generates once every K >= 1 steps")
    try:
        load_config(CONFIG, args.set)  # a wrong --set is refused here, before any run starts
    except UserError as error:
        refuse(f"--set: {error}")
    if args.quick and args.save:
        refuse("--quick checks that the benchmark works; its numbers are not recorded (drop --save)")
    if args.quick:
        args.steps, args.seeds, args.eval_every = 10, args.seeds[:1], 5
    console = Console()
    result = run(args, console)
    console.print(summary_table(result))
    text = report(result)
    name = record_name("peer_trl", args.label)
    stem = save(name, result, text, Path(args.root))  # under --root, --save or not
    plot(result, stem.with_suffix(".png"))
    console.print(f"result in {stem}.md, .json and .png")
    if args.save:
        recorded = save(name, result, text)
        shutil.copyfile(stem.with_suffix(".png"), recorded.with_suffix(".png"))
        console.print(f"recorded {recorded}.md, .json and .png")


if __name__ == "__main__":
    main()
