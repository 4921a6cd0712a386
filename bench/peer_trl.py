"""The quickstart's asynchronous GRPO against Hugging Face TRL's ``GRPOTrainer`` on the same task: the same
start model, prompts in the same order and the same reward decision; each side trains alone in its own
process tree, saves checkpoints at the same steps, and the checkpoints the final accuracy averages (both
sides', at the same steps) are evaluated afterwards by the same evaluator (``areal-hpc eval``). Seeds run one
at a time, ours then TRL's.

    .venv/bin/python bench/peer_trl.py [--steps 200] [--n-seeds 10 | --seeds 1 2 ...] [--start-model DIR] [--save]
                                       [--eval-every-checkpoint]   # the whole accuracy-by-step curve
    .venv/bin/python bench/peer_trl.py --quick          # 6 steps, 1 seed, 100 held-out problems: does it work

Wall time of ``--n-seeds 10`` at the defaults on an idle 2-core machine: about 30-35 min (with the warm-up
reused: ``--start-model`` or an earlier run under the same ``--root``; building it adds a few minutes). Each
seed takes about 3 min: ours' run about 45 s, TRL's about 85 s, and 6 evaluations (3 checkpoints a side) of
about 10 s each, most of it the ``areal-hpc eval`` process starting. ``--eval-every-checkpoint`` evaluates
all 10 checkpoints a side (20 evaluations a seed, about 5.5 min a seed, about an hour in all).

TRL comes with the dev lock: ``make .venv/.installed-dev`` (what ``make test`` installs).

- Start model: ``--start-model DIR``, else the quickstart's SFT warm-up (``areal-hpc sft``, up to
  ``rl.sft_warmup_steps`` steps, stopping at ``sft.stop_at_accuracy``), built once under ``--root`` and reused.
- ours: ``python -m areal_hpc train --config configs/quickstart.yaml`` from that model, as ``make demo`` runs it
  (``rl.sft_warmup_steps=0``), with ``saver.freq_steps`` = the checkpoint interval (``--eval-every``) and
  ``rl.eval_every_steps=0``. The run still evaluates at step 0 (on its rollout server, beside its first steps)
  and after its last step, and writes its final model: ``areal-hpc train`` has no switch for these. It keeps
  its last 2 checkpoints; this harness hard-links each one it will evaluate (``checkpoints/stepN/actor``, a
  Hugging Face folder) as it appears.
- TRL: ``bench/peer_trl_child.py`` in a process of its own that imports torch, transformers, datasets and trl
  and nothing of this project (it asserts so at its end; the parent checks its report). Before it starts the
  parent writes its spec: the model folder; the prompts ``PromptStream`` draws for that seed, in that order,
  as chat messages (TRL renders them with the tokenizer's chat template; the first 2 steps' rendering is
  checked before the run, and every row ``generate()`` received after it, token for token against the
  project's ``example_prompt_ids``), each with its answer; and ``GRPOConfig``'s arguments mapped from the
  project's config: 16 prompts x 8 samples per step, one generation and one optimizer step per step
  (``num_iterations=1``, ``shuffle_dataset=False``), learning rate, schedule and warm-up
  (``constant_with_warmup`` for the quickstart's constant schedule), weight decay, Adam's betas and eps,
  gradient clipping, clip range, KL coefficient (0), temperature, top-p/top-k, max_new_tokens, bfloat16
  compute, token-mean loss (``loss_type="dapo"``), group-normalised advantages. TRL's own AdamW and
  scheduler, torch's own thread count (``OMP_NUM_THREADS`` is removed from its environment). Its reward is a
  plain re-implementation of the arithmetic task's (the last number equals the answer): before any run the
  parent checks it against the project's reward on edge cases and the held-out problems, after each TRL run
  on the first group of every generation it scored, and after every evaluation on every episode evaluated
  (100% agreement or the bench stops). The Trainer saves full checkpoints (its default: model and tokenizer
  with ``save_pretrained``, optimizer, scheduler, RNG) every ``save_steps`` and at the end.
- Checkpoints: both sides save at every multiple of the interval and at the last step (ours'
  ``saver.freq_steps`` takes an interval, not a list of steps), so both timed windows hold the same saves.
- Evaluation: after each training run has ended, ``areal-hpc eval --config configs/quickstart.yaml --model
  CHECKPOINT --json`` (greedy, the quickstart's 500 held-out problems, or ``--eval-limit`` of them), one
  process per checkpoint (it evaluates one model a call), of the last ``LAST_EVALS`` checkpoints (steps 160,
  180 and 200 at the defaults; ``eval_steps``), or of every checkpoint with ``--eval-every-checkpoint``; the
  start model once, as step 0 of every run. Final accuracy: the mean of the last ``LAST_EVALS`` evaluations,
  the same checkpoints either way. Each run's evaluations go to ``<run>/evals.json`` (step, accuracy, ...).
  Ours' own evaluations at step 0 and at the end are recorded beside (``in_run_evals``).
- Speed: from the step-end times both sides write (ours' metrics.jsonl, the child's, one per step), over the
  steps after the first ``SKIP_STEPS`` and after ours' step-0 evaluation has ended: wall seconds per step, and
  CPU seconds per step of the run's whole process tree (utime + stime of every process in it and of the
  children they waited for, from /proc/<pid>/stat, sampled every ``SAMPLE_S`` seconds and interpolated at the
  window's ends). Both windows contain the checkpoint saves. Beside them, each run's whole wall and CPU time.
- Memory: PSS of the whole process tree (every descendant, /proc/<pid>/smaps_rollup) every ``SAMPLE_S`` s:
  the peak, and the median of the second half of the run (steady state).
- Summary: ours / TRL ratios of the per-side medians over seeds (CPU-s/step, wall s/step, peak and steady
  PSS), and ours minus TRL's final accuracy seed by seed with its 95% interval (Student's t over the seeds):
  "parity" when the interval spans zero, else "ours higher" or "TRL higher".

What cannot be made equal (TRL has no knob for it): TRL is synchronous and on-policy, ours trains batches up
to 2 versions stale (the point of the comparison), its batches the first 16 groups to finish of the prompts
drawn in that order, TRL's exactly the next 16; TRL divides advantages by the Bessel-corrected group std +
1e-4, ours by the population std + 1e-6; TRL's ``generate()`` runs under bfloat16 autocast, ours samples in
float32 on its rollout server; Hugging Face's warm-up starts at 0 (step k at k/W of the peak), ours at 1/W
(step k at (k+1)/W); Hugging Face exempts biases and norm weights from weight decay by name, ours every
1-dimensional parameter; ours evaluates in process at step 0 and at the end and writes its final model, TRL
neither.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
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
import itertools

from async_vs_sync import cpu_seconds
from peer_trl_child import answer_reward
from recording import machine, machine_and_versions, record_name, save, train_command
from run_processes import process_tree, pss_mib

from areal_hpc.config import load_config
from areal_hpc.errors import UserError
from areal_hpc.fsio import read_json_lines

REPO = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().with_name("peer_trl_child.py")
CONFIG = "configs/quickstart.yaml"
INSTALL = "TRL is not installed: make .venv/.installed-dev (the dev lock, which make test installs)"
METHOD = (
    "TRL alone in its process; checkpoints of both sides evaluated by areal-hpc eval"  # pools only with its own kind
)
SKIP_STEPS = 3  # steps left out of the timed window: start-up, the servers' first episodes, allocator warm-up
LAST_EVALS = 3  # evaluations averaged into the final accuracy
SAMPLE_S = 0.5  # seconds between memory and CPU samples
RUN_FILE = "quickstart/trial0/metrics.jsonl"  # under a run's fileroot, for both sides
HARNESS_KEYS = (
    "model.path",
    "rl.sft_warmup_steps",
    "rl.total_train_steps",
    "rl.eval_every_steps",
    "saver.freq_steps",
    "experiment.seed",
    "cluster.fileroot",
)  # set by the harness on both sides: not through --set
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # left out of TRL's environment: torch's own default
QUICK = {"steps": 6, "eval_every": 3, "eval_limit": 100}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def refuse(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """A bad flag is one line on stderr and exit 2."""

    def error(self, message: str) -> None:
        refuse(f"{self.prog}: error: {message}")


# ---- process trees: memory and CPU -------------------------------------------------------------------


def cpu_of(pid: int) -> float:
    """CPU seconds of one process and of the children it waited for (utime + stime + cutime + cstime)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(value) for value in fields[11:15]) / CLOCK_TICKS


class TreeSampler:
    """PSS and CPU seconds of a process tree every SAMPLE_S seconds in a thread, until ``stop``."""

    def __init__(self, root: int):
        self.root, self.samples = root, []  # (time.time(), MiB, CPU seconds)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while True:  # at least one sample, however soon ``stop`` comes
            before, tree = time.time(), process_tree(self.root)
            cpu, mib = sum(map(cpu_of, tree)), sum(map(pss_mib, tree))
            self.samples.append(((before + time.time()) / 2, mib, cpu))
            if self._done.wait(SAMPLE_S):
                return

    def stop(self) -> dict:
        self._done.set()
        self._thread.join()
        started, ended = self.samples[0][0], self.samples[-1][0]
        half = (started + ended) / 2
        values = [mib for _, mib, _ in self.samples]
        return {
            "peak_mib": max(values),
            "steady_mib": statistics.median(m for t, m, _ in self.samples if t >= half),
            "samples": len(values),
        }


def cpu_at(samples: list[tuple[float, float, float]], moment: float) -> float:
    """The tree's CPU seconds at ``moment``, interpolated between the samples around it."""
    for (t0, _, c0), (t1, _, c1) in itertools.pairwise(samples):
        if t0 <= moment <= t1:
            return c0 + (c1 - c0) * (moment - t0) / (t1 - t0) if t1 > t0 else c1
    return samples[0][2] if moment < samples[0][0] else samples[-1][2]


def step_window(records: list[dict], samples: list) -> dict:
    """Wall and CPU seconds per step over the steps after the first SKIP_STEPS that end after every in-run
    evaluation (ours' step 0, beside its first steps) ended, from the step-end times of ``records``."""
    ends = sorted(r["time"] for r in records if "time/step" in r)
    first = ends[min(SKIP_STEPS, len(ends) - 1) - 1]
    evaluated = [r["time"] for r in records if "eval/accuracy" in r and r["time"] < ends[-1]]
    later = [end for end in ends if end >= max([first, *evaluated])]
    alone = len(later) >= 2
    start = later[0] if alone else first
    timed = [end for end in ends if end >= start]
    wall, cpu = timed[-1] - start, cpu_at(samples, timed[-1]) - cpu_at(samples, start)
    steps = len(timed) - 1
    return {
        "steps_timed": steps,
        "s_per_step": wall / steps,
        "cpu_s_per_step": cpu / steps,
        "median_s_per_step": statistics.median(b - a for a, b in itertools.pairwise(timed)),
        "cores_in_steps": cpu / wall if wall else 0.0,
        "timed_beside_evaluation": not alone,
    }


def run_tracked(
    console: Console,
    label: str,
    command: list[str],
    metrics: Path,
    steps: int,
    log: Path,
    env: dict | None = None,
    every_second=None,
) -> tuple[dict, list]:
    """Run ``command`` (output to ``log``), sampling its process tree and showing the steps its metrics file
    records (``every_second`` is called once a second meanwhile and once at the end); (the memory figures,
    the wall and CPU seconds, the cores the run used and those the rest of the machine used meanwhile;
    the samples)."""
    (busy, children), started = cpu_seconds(), time.perf_counter()
    with log.open("w") as out, console.status(f"{label}: starting") as status:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        sampler = TreeSampler(process.pid)
        while process.poll() is None:
            if every_second is not None:
                every_second()
            done = sum("time/step" in r for r in read_json_lines(metrics))
            status.update(
                f"{label}: step {done}/{steps}, {time.perf_counter() - started:.0f} s, "
                f"{sampler.samples[-1][1] if sampler.samples else 0:.0f} MiB"
            )
            time.sleep(1.0)
        result = sampler.stop()
    if every_second is not None:
        every_second()
    (busy_end, children_end), wall = cpu_seconds(), time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"{label} exited with {process.returncode} (log {log}):\n{log.read_text()[-3000:]}")
    used = children_end - children  # CPU seconds of the run's processes (each waited for by its parent)
    return result | {
        "wall_s": wall,
        "cpu_s": used,
        "cores_used": used / wall,
        "other_load": max(0.0, (busy_end - busy - used) / wall),
    }, sampler.samples


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


# ---- the two sides -----------------------------------------------------------------------------------


def base_overrides(model_dir: Path, seed: int, steps: int, extra: list[str]) -> list[str]:
    """The quickstart as both sides run it here, from ``model_dir`` (with ``--set``'s ``extra``)."""
    return [
        f"model.path={model_dir}",
        "rl.sft_warmup_steps=0",
        f"rl.total_train_steps={steps}",
        f"experiment.seed={seed}",
        *extra,
    ]


def keep_checkpoints(run_dir: Path, kept: Path, wanted: set[int]) -> None:
    """Hard links of the model folder of every complete checkpoint of the ``wanted`` steps not kept yet (the run
    deletes all but its last 2)."""
    root = run_dir / "checkpoints"
    for folder in sorted(root.glob("step*")) if root.is_dir() else []:
        target = kept / folder.name
        if (
            folder.name.endswith(".partial")
            or target.exists()
            or not folder.name[4:].isdigit()
            or int(folder.name[4:]) not in wanted
        ):
            continue
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            shutil.copytree(folder / "actor", staging, copy_function=os.link)
            staging.rename(target)
        except (OSError, shutil.Error):  # deleted while being linked: reported as missing after the run
            shutil.rmtree(staging, ignore_errors=True)


def run_ours(
    console: Console,
    root: Path,
    model: Path,
    seed: int,
    steps: int,
    save_every: int,
    extra: list[str],
    wanted: set[int],
) -> tuple[dict, dict[int, Path]]:
    """Ours' run; (its row, the model folders of the checkpoints of the ``wanted`` steps)."""
    fileroot = fresh(root / f"ours-seed{seed}")
    run_dir, kept = (fileroot / RUN_FILE).parent, fileroot / "kept"
    command = train_command(
        CONFIG,
        *base_overrides(model, seed, steps, extra),
        "rl.eval_every_steps=0",
        f"saver.freq_steps={save_every}",
        f"cluster.fileroot={fileroot}",
        "stats.tensorboard=false",
        "stats.plot=false",
    )
    tracked, samples = run_tracked(
        console,
        f"ours, seed {seed}",
        command,
        fileroot / RUN_FILE,
        steps,
        fileroot / "log.txt",
        every_second=lambda: keep_checkpoints(run_dir, kept, wanted),
    )
    records = read_json_lines(fileroot / RUN_FILE)
    row = {
        "trainer": "ours",
        "seed": seed,
        **step_window(records, samples),
        **tracked,
        "mean_reward": statistics.fmean(r["rollout/reward"] for r in records if "rollout/reward" in r),
        "in_run_evals": [{"step": r["step"], "accuracy": r["eval/accuracy"]} for r in records if "eval/accuracy" in r],
    }
    return row, {int(folder.name[4:]): folder for folder in kept.glob("step*") if not folder.name.endswith(".partial")}


def hf_schedule(optimizer, steps: int) -> dict:
    """The project's learning-rate schedule as Hugging Face names it (``trl_cannot_follow`` refuses the rest)."""
    warmup = int(optimizer.warmup_steps_proportion * steps)
    if optimizer.lr_scheduler_type == "constant":
        return {"lr_scheduler_type": "constant_with_warmup" if warmup else "constant", "warmup_steps": warmup}
    if optimizer.lr_scheduler_type == "cosine" and optimizer.min_lr_ratio:
        return {
            "lr_scheduler_type": "cosine_with_min_lr",
            "warmup_steps": warmup,
            "lr_scheduler_kwargs": {"min_lr_rate": optimizer.min_lr_ratio},
        }
    return {"lr_scheduler_type": optimizer.lr_scheduler_type, "warmup_steps": warmup}


def grpo_config(
    cfg, output_dir: Path, seed: int, steps: int, save_every: int, steps_per_generation: int, use_cpu: bool
) -> dict:
    """GRPOConfig's arguments for the run ``cfg`` describes (see the module docstring)."""
    gen, actor, optimizer = cfg.generation, cfg.actor, cfg.optimizer
    return dict(
        output_dir=str(output_dir),
        seed=seed,
        max_steps=steps,
        use_cpu=use_cpu,
        per_device_train_batch_size=cfg.rollout.consumer_batch_size * gen.n_samples,
        gradient_accumulation_steps=1,
        num_generations=gen.n_samples,
        steps_per_generation=steps_per_generation,
        num_iterations=1,
        shuffle_dataset=False,
        max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=max(0, gen.top_k),
        beta=actor.kl_coef,
        epsilon=actor.eps_clip,
        epsilon_high=actor.eps_clip_high or actor.eps_clip,
        loss_type="dapo",
        scale_rewards="group",
        importance_sampling_level=actor.importance_level,
        bf16=cfg.model.compute_dtype == "bfloat16",
        learning_rate=actor.lr,
        weight_decay=optimizer.weight_decay,
        adam_beta1=optimizer.beta1,
        adam_beta2=optimizer.beta2,
        adam_epsilon=optimizer.eps,
        max_grad_norm=optimizer.gradient_clipping,
        **hf_schedule(optimizer, steps),
        save_strategy="steps",
        save_steps=save_every,
        report_to="none",
        disable_tqdm=True,
    )


def trl_cannot_follow(cfg) -> list[str]:
    """Settings that the mapping onto GRPOConfig and the child's reward do not carry (the quickstart sets none)."""
    actor, gen, optimizer = cfg.actor, cfg.generation, cfg.optimizer
    checks = {
        "actor.adv_estimator": actor.adv_estimator == "grpo",
        "actor.aggregation": actor.aggregation == "token-mean",
        "actor.ppo_n_minibatches": actor.ppo_n_minibatches == 1,
        "actor.dynamic_sampling": not actor.dynamic_sampling,
        "actor.overlong_cache_tokens": actor.overlong_cache_tokens == 0,
        "generation.greedy": not gen.greedy,
        "rollout.workflow": cfg.rollout.workflow in ("", "rlvr"),
        "dataset.task": cfg.dataset.task == "arithmetic",
        "reward.fn": not cfg.reward.fn,
        "reward.model": not cfg.reward.model,
        "optimizer.min_lr_ratio": not (optimizer.lr_scheduler_type == "linear" and optimizer.min_lr_ratio),
    }
    return [key for key, holds in checks.items() if not holds]


def project_reward(task):
    """The project's reward of ``task`` as a function of (completion, answer)."""
    from areal_hpc.data.rewards import RewardRequest

    return lambda completion, answer: task.reward(RewardRequest("", completion, [], [], {"answer": answer}))[0]


def edge_cases(answers: list[str]) -> list[tuple[str, str]]:
    """(completion, answer) pairs around each answer: right, wrong, decorated, several numbers, commas, decimals,
    signs, none, and the answer beyond and within the scored tail of a long completion."""
    pairs = [("", "5"), ("no idea", "5"), ("5", ""), ("٥", "5"), ("1e1", "10"), ("12,", "12"), (",12", "12")]  # noqa: RUF001 - the Arabic-Indic five is the point of the case
    for answer in answers:
        number = int(answer)
        pairs += [
            (answer, answer),
            (f"The answer is {answer}.", answer),
            (str(number + 1), answer),
            (f"{answer} or {number + 1}", answer),
            (f"{number + 1}, no: {answer}", answer),
            (f"{answer}.0", answer),
            (f"{answer}.5", answer),
            (f"-{answer}", answer),
            (f"{answer[:1]},{answer[1:]}", answer),
            (f"0{answer}", answer),
            (answer + "x" * 5000, answer),
            ("x" * 5000 + answer, answer),
            (answer + " " + "y" * 4094, answer),
            (f"{number}+{number}={2 * number}", answer),
        ]
    return pairs


def check_rewards(scored: list[tuple[str, str, float]], where: str) -> int:
    """``scored``: (completion, answer, the project's reward); the child's reward must agree on every one."""
    wrong = [(c, a, r, answer_reward(c, a)) for c, a, r in scored if answer_reward(c, a) != r]
    if wrong:
        raise SystemExit(
            f"TRL's reward (bench/peer_trl_child.py) disagrees with the project's on {len(wrong)} of "
            f"{len(scored)} {where}; (completion, answer, project, child): {wrong[:3]}"
        )
    return len(scored)


def trl_rendering(tokenizer, messages: list[list[dict]]) -> list[list[int]]:
    """Prompt ids as TRL renders conversational prompts (one batched ``apply_chat_template``)."""
    rendered = tokenizer.apply_chat_template(
        conversation=messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [list(ids) for ids in rendered["input_ids"]]


def check_prompt_ids(record: Path, rendered: list[list[int]], k: int, expected_rows: int) -> int:
    """Every row TRL's ``generate()`` received is the next prompt of the stream, ``k`` rows each, token for token."""
    row = 0
    for line in record.read_text().splitlines():
        for got in json.loads(line):
            if row >= len(rendered) * k or got != rendered[row // k]:
                want = rendered[row // k] if row < len(rendered) * k else "nothing (past the prompts drawn)"
                raise SystemExit(f"TRL's prompt row {row} is {got}, the project renders {want}")
            row += 1
    if row != expected_rows:
        raise SystemExit(
            f"TRL generated {row} rows, expected {expected_rows}: the prompt check did not see every batch"
        )
    return row


def run_trl(
    console: Console,
    root: Path,
    model: Path,
    seed: int,
    steps: int,
    save_every: int,
    extra: list[str],
    steps_per_generation: int,
) -> tuple[dict, dict[int, Path]]:
    from areal_hpc.data.prompts import PromptStream
    from areal_hpc.models.chat import example_prompt_ids
    from areal_hpc.models.hf import load_tokenizer
    from areal_hpc.parallel.device import resolve_device
    from areal_hpc.resolve import Host, resolve
    from areal_hpc.train.task_setup import open_task

    fileroot = fresh(root / f"trl-seed{seed}")
    run_dir = (fileroot / RUN_FILE).parent
    run_dir.mkdir(parents=True)
    cfg = resolve(load_config(CONFIG, base_overrides(model, seed, steps, extra)), Host.probe()).cfg
    tokenizer = load_tokenizer(model)
    task = open_task(cfg, tokenizer, model, lambda line: None)
    per_step, k = cfg.rollout.consumer_batch_size, cfg.generation.n_samples
    # TRL draws whole generations of ``steps_per_generation`` steps: the last may reach past the steps it trains
    generated = math.ceil(steps / steps_per_generation) * steps_per_generation * per_step
    stream = PromptStream(task.train, cfg.experiment.seed)
    order = [next(stream) for _ in range(generated)]  # the order ours' rollout controller draws
    messages = [list(ex.messages) or [{"role": "user", "content": ex.prompt}] for ex in order]
    rendered = [example_prompt_ids(tokenizer, ex) for ex in order]
    first = 2 * per_step
    if trl_rendering(tokenizer, messages[:first]) != rendered[:first]:
        raise SystemExit("TRL's rendering of the first prompts differs from the project's (example_prompt_ids)")
    files = {
        name: run_dir / f"{name}.{suffix}"
        for name, suffix in (("prompt_ids", "jsonl"), ("rewards", "jsonl"), ("report", "json"), ("spec", "json"))
    }
    spec = {
        "model": str(model),
        "dtype": cfg.model.dtype,
        "attn_implementation": cfg.model.attn_impl,
        "prompts": [{"prompt": m, "answer": ex.answer} for m, ex in zip(messages, order)],
        "grpo_config": grpo_config(
            cfg,
            fileroot / "trl",
            seed,
            steps,
            save_every,
            steps_per_generation,
            resolve_device(cfg.cluster.device).type == "cpu",
        ),
        "metrics": str(fileroot / RUN_FILE),
        **{name: str(path) for name, path in files.items() if name != "spec"},
    }
    files["spec"].write_text(json.dumps(spec))
    env = {name: value for name, value in os.environ.items() if name not in THREAD_VARIABLES} | {"HF_HUB_OFFLINE": "1"}
    tracked, samples = run_tracked(
        console,
        f"TRL, seed {seed}",
        [sys.executable, str(CHILD), str(files["spec"])],
        fileroot / RUN_FILE,
        steps,
        fileroot / "log.txt",
        env,
    )
    report = json.loads(files["report"].read_text())
    if report["areal_hpc_modules"]:
        raise SystemExit(f"TRL's process imported the project: {report['areal_hpc_modules']}")
    rows = check_prompt_ids(files["prompt_ids"], rendered, k, generated * k)
    reward = project_reward(task)
    sampled = [
        (c, a, child, reward(c, a))
        for line in read_json_lines(files["rewards"])
        for c, a, child in zip(line["completions"], line["answers"], line["rewards"])
    ]
    if wrong := [one for one in sampled if one[2] != one[3]]:
        raise SystemExit(
            f"TRL's rewards of {len(wrong)} of the {len(sampled)} training completions it sampled differ "
            f"from the project's; (completion, answer, child, project): {wrong[:3]}"
        )
    records = read_json_lines(fileroot / RUN_FILE)
    row = {
        "trainer": "trl",
        "seed": seed,
        **step_window(records, samples),
        **tracked,
        "mean_reward": statistics.fmean(r["rollout/reward"] for r in records),
        "torch_threads": report["torch_threads"],
        "child_versions": report["versions"],
        "prompt_rows_checked": rows,
        "training_rewards_checked": len(sampled),
    }
    return row, {int(folder.name.split("-")[1]): folder for folder in (fileroot / "trl").glob("checkpoint-*")}


# ---- evaluation --------------------------------------------------------------------------------------


def evaluate(model: Path, out: Path, extra: list[str], limit: int) -> dict:
    """``areal-hpc eval`` of one model folder (greedy, the quickstart's held-out problems); every episode to
    ``out``, where the child's reward is checked against the project's reward that scored it."""
    command = [
        sys.executable,
        "-m",
        "areal_hpc",
        "eval",
        "--config",
        CONFIG,
        "--model",
        str(model),
        "--json",
        "--out",
        str(out),
        *(["--limit", str(limit)] if limit else []),
        *extra,
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"areal-hpc eval of {model} exited with {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    episodes = read_json_lines(out)
    checked = check_rewards([(e["completion"], e["answer"], e["reward"]) for e in episodes], f"episodes of {out}")
    return {
        "accuracy": result["accuracy"],
        "n": result["n"],
        "reward_failures": result["reward_failures"],
        "episode_failures": result["episode_failures"],
        "rewards_checked": checked,
    }


def evaluate_run(
    console: Console,
    label: str,
    fileroot: Path,
    checkpoints: dict[int, Path],
    eval_steps: list[int],
    start: dict,
    extra: list[str],
    limit: int,
) -> dict:
    """The checkpoints of ``eval_steps`` of a finished run, after it, one ``areal-hpc eval`` each (it takes one
    model a call); the start model's evaluation as step 0. All of them to ``fileroot/evals.json``."""
    missing = sorted(set(eval_steps) - set(checkpoints))
    if missing:
        raise SystemExit(f"{label}: no checkpoint of steps {missing} under {fileroot} (saved: {sorted(checkpoints)})")
    started, evals = time.perf_counter(), [{"step": 0, **start}]
    folder = fresh(fileroot / "evals")
    with console.status(f"{label}: evaluating") as status:
        for step in eval_steps:
            status.update(f"{label}: evaluating step {step}'s checkpoint")
            evals.append({"step": step, **evaluate(checkpoints[step], folder / f"step{step:06d}.jsonl", extra, limit)})
    (fileroot / "evals.json").write_text(json.dumps(evals, indent=1) + "\n")
    return {
        "evals": evals,
        "final_accuracy": final_accuracy(evals),
        "eval_wall_s": time.perf_counter() - started,
        "eval_rewards_checked": sum(e["rewards_checked"] for e in evals[1:]),
    }


def start_model(console: Console, root: Path, sft_steps: int) -> Path:
    """The quickstart's SFT warm-up (what ``areal-hpc train`` runs before RL), written under ``root`` once."""
    fileroot = root / f"sft-{sft_steps}"
    model = fileroot / "quickstart" / "trial0" / "model"
    if (model / "config.json").is_file():
        console.print(f"reusing the SFT warm-up in {fileroot} (delete it to build it again)", soft_wrap=True)
        return model
    fresh(fileroot)
    with console.status(f"SFT warm-up, at most {sft_steps} steps"):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "areal_hpc",
                "sft",
                "--config",
                CONFIG,
                f"cluster.fileroot={fileroot}",
                f"sft.total_train_steps={sft_steps}",
                "saver.freq_steps=0",
                "stats.tensorboard=false",
                "stats.plot=false",
            ],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return model


# ---- summary -----------------------------------------------------------------------------------------


def verdict(interval: list[float] | None) -> str:
    """ "parity" when the 95% interval of ours minus TRL spans zero, else which side is higher."""
    if interval is None:
        return "no interval (fewer than 2 seeds)"
    low, high = interval
    return "parity" if low <= 0 <= high else "ours higher" if low > 0 else "TRL higher"


def paired_difference(ours: list[dict], trl: list[dict]) -> dict:
    """Final accuracy, ours minus TRL's, seed by seed (the two sides of a seed see the same prompts): the mean,
    its standard error and a 95% interval (Student's t over the seeds)."""
    trl_final = {r["seed"]: r["final_accuracy"] for r in trl}
    differences = [r["final_accuracy"] - trl_final[r["seed"]] for r in ours if r["seed"] in trl_final]
    if len(differences) < 2:
        return {"seeds": len(differences), "mean": statistics.fmean(differences) if differences else None}
    mean, error = statistics.fmean(differences), statistics.stdev(differences) / math.sqrt(len(differences))
    half = scipy.stats.t.ppf(0.975, len(differences) - 1) * error
    return {
        "seeds": len(differences),
        "mean": mean,
        "standard_error": error,
        "ci95": [float(mean - half), float(mean + half)],
    }


def summarise(rows: list[dict]) -> dict:
    """Ours / TRL: the ratios of the per-side medians over seeds; the paired accuracy difference and its verdict."""
    ours, trl = ([r for r in rows if r["trainer"] == name] for name in ("ours", "trl"))
    median = lambda side, key: statistics.median(r[key] for r in side)  # noqa: E731
    out = {
        "accuracy_paired": paired_difference(ours, trl),
        "final_accuracy_mean": {
            "ours": statistics.fmean(r["final_accuracy"] for r in ours),
            "trl": statistics.fmean(r["final_accuracy"] for r in trl),
        },
    }
    for key in ("cpu_s_per_step", "s_per_step", "peak_mib", "steady_mib"):
        out[f"{key}_median"] = {"ours": median(ours, key), "trl": median(trl, key)}
        out[f"{key}_ratio"] = median(ours, key) / median(trl, key)
    out["accuracy_verdict"] = verdict(out["accuracy_paired"].get("ci95"))
    return out


def summary_line(s: dict) -> str:
    paired, m = (
        s["accuracy_paired"],
        lambda key, unit, f: (
            f"{s[key + '_ratio']:.2f}x ({s[key + '_median']['ours']:{f}} vs {s[key + '_median']['trl']:{f}} {unit})"
        ),
    )
    accuracy = f"accuracy: {s['accuracy_verdict']}"
    if paired["mean"] is not None:
        accuracy += f", ours - TRL {100 * paired['mean']:+.2f} points"
    if "ci95" in paired:
        accuracy += (
            f" (95% interval {100 * paired['ci95'][0]:+.2f} to {100 * paired['ci95'][1]:+.2f}, {paired['seeds']} seeds)"
        )
    return (
        f"{accuracy}; ours / TRL (medians over seeds): CPU-s/step {m('cpu_s_per_step', 's', '.3f')}, "
        f"wall s/step {m('s_per_step', 's', '.3f')}, peak PSS {m('peak_mib', 'MiB', '.0f')}, "
        f"steady PSS {m('steady_mib', 'MiB', '.0f')}"
    )


def run_table(row: dict) -> Table:
    table = Table(title=f"{row['trainer']}, seed {row['seed']}", show_header=False)
    for name, value in (
        (
            "timed steps: wall s/step (median), CPU-s/step, cores",
            f"{row['s_per_step']:.3f} ({row['median_s_per_step']:.3f}), {row['cpu_s_per_step']:.3f}, "
            f"{row['cores_in_steps']:.2f} over {row['steps_timed']} steps",
        ),
        ("final accuracy", f"{row['final_accuracy']:.1%}"),
        ("accuracy by step", " ".join(f"{e['step']}: {e['accuracy']:.1%}" for e in row["evals"])),
        ("mean training reward", f"{row['mean_reward']:.3f}"),
        ("PSS of the process tree (peak, steady)", f"{row['peak_mib']:.0f}, {row['steady_mib']:.0f} MiB"),
        (
            "whole run: wall s, CPU s, other load (cores)",
            f"{row['wall_s']:.0f}, {row['cpu_s']:.0f}, {row['other_load']:.2f}",
        ),
    ):
        table.add_row(name, value)
    return table


def report(r: dict) -> str:
    s = r["summary"]
    every = len(r["evaluated_steps"]) - 1 == len(checkpoint_steps(r["steps"], r["save_every"]))
    which = (
        "every checkpoint" + (", --eval-every-checkpoint" if r["eval_every_checkpoint"] else "")
        if every
        else f"the last {r['last_evals']}, those the final accuracy averages; all with --eval-every-checkpoint"
    )
    lines = [
        f"# ours vs TRL GRPOTrainer on the quickstart ({r['date']})",
        "",
        machine_and_versions(r),
        "",
        f"Rerun: `{r['command']}`",
        "",
        f"{r['steps']} steps of 16 prompts x 8 samples from {r['start_model']}, seeds {r['seeds']}, one run at a time "
        f"(ours, then TRL's); checkpoints every {r['save_every']} steps and at the end; after each run "
        f"`areal-hpc eval` (greedy, {r['eval_problems']} held-out problems) evaluated those of steps "
        f"{', '.join(map(str, r['evaluated_steps'][1:]))} ({which}), the start model as step 0; final accuracy "
        f"the mean of the last {r['last_evals']} evaluations; wall and CPU seconds per step over the steps "
        f"after the first {r['skip_steps']} (and after ours' step-0 evaluation); memory the PSS of each run's "
        "process tree. TRL ran alone in its process (bench/peer_trl_child.py, no areal_hpc module loaded) with "
        f"torch's own threads ({r['trl_torch_threads']}).",
        "",
        f"Overrides on both sides: {' '.join(r.get('overrides', [])) or 'none'}; TRL generates every "
        f"{r.get('trl_steps_per_generation', 1)} optimizer step(s).",
        "",
        f"**{summary_line(s)}**",
        "",
        "| trainer | seed | wall s/step | median s/step | CPU-s/step | cores | final accuracy | accuracy by evaluated step | "
        "mean reward | PSS peak (MiB) | PSS steady (MiB) | wall s | CPU s | other load (cores) |",
        "|---" * 14 + "|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['trainer']} | {row['seed']} | {row['s_per_step']:.3f} | {row['median_s_per_step']:.3f} | "
            f"{row['cpu_s_per_step']:.3f} | {row['cores_in_steps']:.2f} | {row['final_accuracy']:.1%} | "
            + " ".join(f"{e['step']}: {e['accuracy']:.1%}" for e in row["evals"])
            + f" | {row['mean_reward']:.3f} | {row['peak_mib']:.0f} | {row['steady_mib']:.0f} | "
            f"{row['wall_s']:.0f} | {row['cpu_s']:.0f} | {row['other_load']:.2f} |"
        )
    means = s["final_accuracy_mean"]
    trl_rows, ours_rows = ([row for row in r["rows"] if row["trainer"] == name] for name in ("trl", "ours"))
    lines += [
        "",
        f"Mean final accuracy: ours {means['ours']:.2%}, TRL {means['trl']:.2%}.",
        "Checks: TRL's prompt rows equal to the project's rendering: "
        f"{sum(row['prompt_rows_checked'] for row in trl_rows)}; its reward equal to the project's on "
        f"{r['reward_edge_cases']} edge cases before the runs, {sum(row['training_rewards_checked'] for row in trl_rows)} "
        f"training completions and {r['start_eval']['rewards_checked'] + sum(row['eval_rewards_checked'] for row in r['rows'])} "
        "evaluated episodes.",
        f"Ours' own evaluations in the run (on all {r['in_run_eval_problems']} held-out problems; compare them with "
        "`areal-hpc eval` of the same weights above where that evaluated them all): "
        + "; ".join(
            f"seed {row['seed']} " + ", ".join(f"step {e['step']} {e['accuracy']:.1%}" for e in row["in_run_evals"])
            for row in ours_rows
        )
        + ".",
    ]
    return "\n".join(lines)


def adjacent_runs(steps: list[int], gap: int) -> list[list[int]]:
    """``steps`` (sorted) cut where two neighbours lie more than ``gap`` apart: the stretches evaluated at every
    checkpoint, drawn solid; the jumps between them (checkpoints not evaluated) dotted."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step - runs[-1][-1] <= gap:
            runs[-1].append(step)
        else:
            runs.append([step])
    return runs


def plot(result: dict, out: Path) -> None:
    """Held-out accuracy at the evaluated steps (each seed's points faint, the mean over seeds bold; the start
    model, step 0, a legend entry when only the last checkpoints were evaluated), ours minus TRL's final
    accuracy seed by seed with the mean and its 95% interval, and each run's CPU-s/step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (curves, paired, speed) = plt.subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [2, 1.2, 1.2]})
    evaluated = sorted({e["step"] for r in result["rows"] for e in r["evals"]})
    whole_curve = len(adjacent_runs(evaluated, result["save_every"])) == 1  # step 0 and every checkpoint after it
    if not whole_curve:  # the start model apart, so that the points at the last checkpoints can be told apart
        curves.plot([], [], " ", label=f"start model (step 0): {result['start_eval']['accuracy']:.1%}")
    dotted = False
    for trainer, colour, side in (("ours", "tab:blue", -1), ("trl", "tab:orange", 1)):
        rows = [r for r in result["rows"] if r["trainer"] == trainer]
        label = "ours" if trainer == "ours" else "TRL GRPOTrainer"
        shift = side * result["save_every"] / 8  # the two sides' points side by side at each step
        shown = [[e for e in r["evals"] if whole_curve or e["step"] > 0] for r in rows]
        curves.scatter(
            [e["step"] + shift for evals in shown for e in evals],
            [e["accuracy"] for evals in shown for e in evals],
            color=colour,
            alpha=0.35,
            s=9,
            linewidths=0,
        )
        steps = sorted({e["step"] for evals in shown for e in evals})  # pooled records may have evaluated more
        mean = {
            step: statistics.fmean(e["accuracy"] for evals in shown for e in evals if e["step"] == step)
            for step in steps
        }
        final = statistics.fmean(r["final_accuracy"] for r in rows)
        curves.plot(steps, [mean[step] for step in steps], color=colour, linewidth=1, linestyle=":")
        stretches = adjacent_runs(steps, result["save_every"])
        dotted = dotted or len(stretches) > 1
        for n, stretch in enumerate(stretches):
            curves.plot(
                stretch,
                [mean[step] for step in stretch],
                color=colour,
                linewidth=2,
                marker="o",
                markersize=4,
                label=f"{label}: last {result['last_evals']} evaluations {final:.1%}" if n == 0 else None,
            )
        speed.scatter(
            [r["seed"] for r in rows],
            [r["cpu_s_per_step"] for r in rows],
            color=colour,
            label=f"{label}: {statistics.median(r['cpu_s_per_step'] for r in rows):.3f} CPU-s median",
        )
    curves.set_xlabel(
        "RL step"
        + ("" if whole_curve else ", the checkpoints evaluated")
        + (" (dotted: across checkpoints not evaluated)" if dotted else "")
    )
    curves.set_ylabel("held-out accuracy (areal-hpc eval, greedy)")
    curves.grid(alpha=0.3)
    curves.legend(loc="lower right")
    trl_final = {r["seed"]: r["final_accuracy"] for r in result["rows"] if r["trainer"] == "trl"}
    differences = sorted(
        (r["seed"], 100 * (r["final_accuracy"] - trl_final[r["seed"]]))
        for r in result["rows"]
        if r["trainer"] == "ours" and r["seed"] in trl_final
    )
    paired.axhline(0, color="black", linewidth=0.8)
    paired.scatter(
        [seed for seed, _ in differences], [d for _, d in differences], color="tab:green", s=14, label="one seed"
    )
    s, difference = result["summary"], result["summary"]["accuracy_paired"]
    if difference["mean"] is not None:
        paired.axhline(
            100 * difference["mean"], color="tab:green", linewidth=2, label=f"mean {100 * difference['mean']:+.2f}"
        )
    if "ci95" in difference:
        low, high = (100 * bound for bound in difference["ci95"])
        paired.axhspan(low, high, color="tab:green", alpha=0.15, label=f"95% interval {low:+.2f} to {high:+.2f}")
    paired.set_xlabel("seed")
    paired.set_ylabel("ours - TRL final accuracy (points)")
    paired.grid(alpha=0.3)
    paired.legend(loc="best", fontsize=8)
    seeds = [r["seed"] for r in result["rows"]]
    for axes in (paired, speed):
        axes.set_xlim(min(seeds) - 0.5, max(seeds) + 0.5)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    speed.set_xlabel("seed")
    speed.set_ylabel("CPU seconds per step (process tree)")
    speed.set_ylim(bottom=0)
    speed.grid(alpha=0.3)
    speed.legend(loc="best", fontsize=8)
    fig.suptitle(
        f"ours vs TRL on the quickstart ({result['date']}): accuracy {s['accuracy_verdict']}\n"
        f"ours / TRL: {s['cpu_s_per_step_ratio']:.2f}x the CPU per step, {s['peak_mib_ratio']:.2f}x the peak "
        "PSS (medians over seeds)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# ---- the run -----------------------------------------------------------------------------------------


def pooled_rows(records: list[Path], settings: dict, seeds: list[int]) -> list[dict]:
    """The runs of earlier records of this benchmark (``--pool-with``), made the same way (``METHOD``) under the
    same ``settings`` and on other seeds; anything else is refused (exit 2) before a run starts."""
    rows: list[dict] = []
    for path in records:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            refuse(f"--pool-with {path}: not a readable JSON record of this benchmark ({error})")
        if (
            not isinstance(record, dict)
            or record.get("benchmark") != "peer_trl"
            or not isinstance(record.get("rows"), list)
        ):
            refuse(f"--pool-with {path}: not a record of peer_trl (a bench/results/peer_trl-*.json)")
        for key, value in settings.items():
            if record.get(key) != value:
                refuse(
                    f"--pool-with {path}: its {key} is {record.get(key)!r}, this run's {value!r}; "
                    "only records made under the same settings pool"
                )
        rows += record["rows"]
    runs = Counter(
        [(r["trainer"], r["seed"]) for r in rows] + [(side, seed) for seed in seeds for side in ("ours", "trl")]
    )
    repeated = sorted({seed for (_, seed), count in runs.items() if count > 1})
    if repeated:
        refuse(
            f"--pool-with: seeds {repeated} would count twice (in two records, or in a record and this run); "
            "pool records of other seeds and run other seeds"
        )
    return rows


def checkpoint_steps(steps: int, save_every: int) -> list[int]:
    """The steps both sides save a checkpoint at: every ``save_every``-th and the last."""
    return sorted({*range(save_every, steps + 1, save_every), steps})


def eval_steps(steps: int, save_every: int, every_checkpoint: bool = False) -> list[int]:
    """The checkpoints evaluated after each run: the last LAST_EVALS saved (what ``final_accuracy`` averages,
    with the start model as step 0 before them), or every one (``--eval-every-checkpoint``)."""
    saved = checkpoint_steps(steps, save_every)
    return saved if every_checkpoint else saved[-LAST_EVALS:]


def final_accuracy(evals: list[dict]) -> float:
    """The mean accuracy of the run's last LAST_EVALS checkpoints (fewer where it saved fewer). The start
    model (step 0) never counts: both sides share it, and it would pull their difference towards zero."""
    trained = sorted((e for e in evals if e["step"] > 0), key=lambda e: e["step"])
    return statistics.fmean(e["accuracy"] for e in trained[-LAST_EVALS:])


def run(args, console: Console) -> dict:
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    cfg = load_config(CONFIG)
    sft_steps = args.sft_steps or cfg.rl.sft_warmup_steps
    save_every = args.eval_every or args.steps
    settings = {
        "machine": machine(),
        "method": METHOD,
        "steps": args.steps,
        "eval_every": save_every,
        "eval_problems": args.eval_limit or cfg.dataset.eval_size,
        "start_model": args.start_model or f"SFT warm-up, at most {sft_steps} steps",
        "versions": {
            "python": platform.python_version(),
            **{name: importlib.metadata.version(name) for name in ("torch", "trl", "transformers")},
        },
    }
    if args.set:
        settings["overrides"] = args.set
    if args.trl_steps_per_generation != 1:
        settings["trl_steps_per_generation"] = args.trl_steps_per_generation
    earlier = pooled_rows(args.pool_with, settings, args.seeds)
    model = Path(args.start_model).resolve() if args.start_model else start_model(console, root, sft_steps)
    console.print(f"start model: {model} (reuse it with --start-model {model})", soft_wrap=True)
    with console.status("evaluating the start model"):
        start = evaluate(model, fresh(root / "start-eval") / "step000000.jsonl", args.set, args.eval_limit)
    console.print(f"start model: {start['accuracy']:.1%} of {start['n']} held-out problems")
    steps_evaluated, rows = eval_steps(args.steps, save_every, args.eval_every_checkpoint), []
    skipped = len(checkpoint_steps(args.steps, save_every)) - len(steps_evaluated)
    console.print(
        f"checkpoints every {save_every} steps and at the end; evaluated after each run: steps "
        f"{', '.join(map(str, steps_evaluated))}"
        + (
            f" (the last {LAST_EVALS}; all {skipped + len(steps_evaluated)}: --eval-every-checkpoint)"
            if skipped
            else ""
        )
    )
    for seed in args.seeds:
        for side in ("ours", "trl"):
            if side == "ours":
                row, checkpoints = run_ours(
                    console, root, model, seed, args.steps, save_every, args.set, set(steps_evaluated)
                )
            else:
                row, checkpoints = run_trl(
                    console, root, model, seed, args.steps, save_every, args.set, args.trl_steps_per_generation
                )
            label = f"{'ours' if side == 'ours' else 'TRL'}, seed {seed}"
            rows.append(
                row
                | evaluate_run(
                    console,
                    label,
                    root / f"{side}-seed{seed}",
                    checkpoints,
                    steps_evaluated,
                    start,
                    args.set,
                    args.eval_limit,
                )
            )
            console.print(run_table(rows[-1]))
    rows = earlier + rows
    threads = sorted({r["torch_threads"] for r in rows if r["trainer"] == "trl"})
    return {
        "benchmark": "peer_trl",
        "date": date.today().isoformat(),
        **settings,
        "save_every": save_every,
        "evaluated_steps": [0, *steps_evaluated],
        "eval_every_checkpoint": args.eval_every_checkpoint,
        "command": " ".join([".venv/bin/python", "bench/peer_trl.py", *map(shlex.quote, sys.argv[1:])]),
        "seeds": sorted({r["seed"] for r in rows}),
        "pooled_with": [str(path) for path in args.pool_with],
        "trl_torch_threads": ", ".join(map(str, threads)),
        "skip_steps": SKIP_STEPS,
        "last_evals": LAST_EVALS,
        "reward_edge_cases": args.edge_cases,
        "in_run_eval_problems": load_config(CONFIG, args.set).dataset.eval_size,
        "start_eval": start,
        "rows": rows,
        "summary": summarise(rows),
    }


def check_before(args) -> None:
    """Everything that can be refused before a run starts (one line, exit 2)."""
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        refuse(INSTALL)
    if args.quick and args.save:
        refuse("--quick checks that the benchmark works; its numbers are not recorded (drop --save)")
    if args.quick:
        args.steps, args.eval_every = QUICK["steps"], QUICK["eval_every"]
        args.eval_limit = args.eval_limit or QUICK["eval_limit"]
        args.seeds = (args.seeds or [1])[:1]
    args.seeds = args.seeds or list(range(1, args.n_seeds + 1))
    for flag, value, least in (
        ("--steps", args.steps, 2),
        ("--n-seeds", args.n_seeds, 1),
        ("--eval-every", args.eval_every, 0),
        ("--eval-limit", args.eval_limit, 0),
        ("--sft-steps", args.sft_steps, 0),
        ("--trl-steps-per-generation", args.trl_steps_per_generation, 1),
    ):
        if value is not None and value < least:
            refuse(f"{flag} {value}: at least {least}")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        refuse(f"--seeds {' '.join(map(str, args.seeds))}: each seed once, none negative")
    if args.start_model and not (Path(args.start_model) / "config.json").is_file():
        refuse(f"--start-model {args.start_model}: not a Hugging Face model folder (no config.json)")
    for override in args.set:
        if override.split("=", 1)[0].strip() in HARNESS_KEYS:
            refuse(
                f"--set {override}: set by the harness on both sides (--steps, --eval-every, --seeds, --start-model, "
                "--root)"
            )
    try:
        cfg = load_config(CONFIG, args.set)  # a wrong --set is refused here, before any run starts
    except UserError as error:
        refuse(f"--set: {error}")
    if unmatched := trl_cannot_follow(cfg):
        refuse(
            f"{CONFIG} with --set {' '.join(args.set)} sets what the TRL side does not carry: {', '.join(unmatched)}"
        )
    from areal_hpc.data.registry import build_task

    task = build_task(cfg.dataset, cfg.reward)
    reward = project_reward(task)
    cases = edge_cases(sorted({ex.answer for ex in task.eval}))
    try:
        args.edge_cases = check_rewards([(c, a, reward(c, a)) for c, a in cases], "edge cases")
    except SystemExit as error:
        refuse(str(error))


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="RL steps of every run")
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", type=int, nargs="+", help="seeds, each run by ours then TRL")
    seeds.add_argument("--n-seeds", type=int, default=10, help="seeds 1..N (default 10)")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="steps between checkpoints (default: the "
        f"quickstart's rl.eval_every_steps; 0: the last only); the last {LAST_EVALS} are evaluated",
    )
    parser.add_argument(
        "--eval-every-checkpoint",
        action="store_true",
        help="evaluate every checkpoint, not only the last "
        f"{LAST_EVALS} that the final accuracy averages: the whole accuracy-by-step curve",
    )
    parser.add_argument(
        "--eval-limit",
        type=int,
        default=0,
        help="evaluate on the first N held-out problems (default: all of the quickstart's)",
    )
    parser.add_argument(
        "--start-model",
        default="",
        help="start model folder (default: the quickstart's SFT warm-up, built once under --root)",
    )
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=0,
        help="at most this many steps of that warm-up (default: the quickstart's rl.sft_warmup_steps)",
    )
    parser.add_argument("--root", default="runs/bench/peer_trl", help="folder of the runs (and of the warm-up)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a check that it works: 6 steps, 1 seed, a checkpoint every 3, 100 held-out problems",
    )
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    parser.add_argument("--label", default="", help="results file peer_trl-LABEL-<date>")
    parser.add_argument(
        "--pool-with",
        type=Path,
        nargs="+",
        default=[],
        metavar="RECORD.json",
        help="earlier records of this benchmark (same machine, versions, method, steps, evaluations "
        "and start model; other seeds) whose runs the summary counts beside this run's",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for both sides (repeatable; TRL refuses what it cannot follow)",
    )
    parser.add_argument(
        "--trl-steps-per-generation",
        type=int,
        default=1,
        metavar="K",
        help="TRL generates once every K optimizer steps, so its j-th step of each K trains on "
        "answers j versions old, importance-weighted by its PPO ratio (1: on-policy)",
    )
    args = parser.parse_args()
    check_before(args)
    if args.eval_every is None:
        args.eval_every = load_config(CONFIG, args.set).rl.eval_every_steps
    console = Console()
    result = run(args, console)
    console.print(summary_line(result["summary"]), soft_wrap=True)
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
