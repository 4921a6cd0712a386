"""On-policy distillation against RL alone on the quickstart task, through the real commands:

    .venv/bin/python bench/distill_demo.py --start-model runs/bench/demo_start/seed1-45.8 [--seeds 1 2 3] [--save]

1. The teacher: ``areal-hpc train`` (the quickstart's asynchronous GRPO) from the start model for
   ``--teacher-steps`` steps; its accuracy is the mean of its last three evaluations.
2. It is served by ``areal-hpc serve`` (the embedded engine) on a loopback port.
3. Per seed, from the same start model for ``--steps`` steps, evaluated every ``--eval-every`` steps
   (500 held-out problems, greedy): RL alone (the rule reward), distillation alone
   (``distill.reward_weight=0``) and both (``distill.reward_weight=1``).
The question (issue 24): does the distilled student reach 90% of the teacher's accuracy in fewer steps
than RL alone? Each run writes into ``--workdir`` and is skipped when it is there already.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from recording import REPO, last3, machine, once, records, run_and_record

CLI = [sys.executable, "-m", "areal_hpc"]
QUIET = ["saver.freq_steps=0", "stats.tensorboard=false", "stats.plot=false"]
ARMS = {"rl": [], "distill": ["distill.reward_weight=0"], "distill+reward": ["distill.reward_weight=1"]}


@contextlib.contextmanager
def served(model: Path, work: Path):
    """``areal-hpc serve`` of ``model`` on a free loopback port; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(work / "teacher-serve.log", "w")  # noqa: SIM115 - the server writes it for its lifetime
    server = subprocess.Popen(
        [
            *CLI,
            "serve",
            "backend=embedded",
            f"model.path={model}",
            "host=127.0.0.1",
            f"port={port}",
            f"cluster.fileroot={work / 'teacher-serve'}",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the teacher's server did not come up; see {log.name}")
            time.sleep(1)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def accuracy_curve(folder: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["eval/accuracy"]) for r in records(folder / "quickstart" / "trial0") if "eval/accuracy" in r]


def train(work: Path, name: str, start: Path, seed: int, steps: int, eval_every: int, extra: list[str]) -> dict:
    folder = work / name
    seconds = once(
        work / f"{name}.done",
        [
            *CLI,
            "train",
            "--config",
            "configs/quickstart.yaml",
            f"model.path={start}",
            f"cluster.fileroot={folder}",
            f"experiment.seed={seed}",
            "rl.sft_warmup_steps=0",
            f"rl.total_train_steps={steps}",
            f"rl.eval_every_steps={eval_every}",
            *QUIET,
            *extra,
        ],
        work / f"{name}.log",
    )
    evals = accuracy_curve(folder)
    return {"seed": seed, "evals": evals, "seconds": seconds, "final": last3([a for _, a in evals]), "folder": folder}


def run(args) -> dict:
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    teacher = train(work, "teacher", args.start_model, 1, args.teacher_steps, 20, [])
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "start_model": str(args.start_model),
        "teacher": {
            "steps": args.teacher_steps,
            "evals": teacher["evals"],
            "final": teacher["final"],
            "seconds": teacher["seconds"],
        },
        "steps": args.steps,
        "eval_every": args.eval_every,
        "runs": [],
    }
    with served(teacher["folder"] / "quickstart" / "trial0" / "model", work) as url:
        for seed in args.seeds:
            for arm, extra in ARMS.items():
                teacher_args = [f"distill.teacher_url={url}"] if arm != "rl" else []
                one = train(
                    work, f"{arm}-s{seed}", args.start_model, seed, args.steps, args.eval_every, [*extra, *teacher_args]
                )
                kl = [
                    r["distill/reverse_kl"]
                    for r in records(one.pop("folder") / "quickstart" / "trial0")
                    if "distill/reverse_kl" in r
                ]
                result["runs"].append({"arm": arm, **one, "reverse_kl": [kl[0], kl[-1]] if kl else None})
    return result


def steps_to(evals: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step at or above ``target`` (None: never)."""
    return next((step for step, accuracy in evals if accuracy >= target), None)


def report(result: dict) -> str:
    teacher = result["teacher"]["final"]
    target = 0.9 * teacher
    start = result["runs"][0]["evals"][0][1]
    lines = [
        f"# on-policy distillation against RL alone ({result['date']})",
        "",
        f"machine: {result['machine']}; start model {result['start_model']} (held-out accuracy {start:.1%}); "
        f"teacher: the quickstart's GRPO for {result['teacher']['steps']} steps from it, final accuracy "
        f"**{teacher:.1%}** (mean of its last 3 evaluations; {result['teacher']['seconds']:.0f} s), served by "
        f"`areal-hpc serve`; target = 90% of it = {target:.1%}",
        "",
        f"{result['steps']} steps per run, greedy accuracy on 500 held-out problems every "
        f"{result['eval_every']} steps; final = mean of the last 3 evaluations",
        "",
        "| arm | seeds | steps to the target (per seed) | final (mean ± sd) | final / teacher | reverse KL first -> last step | s per run |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        runs = [r for r in result["runs"] if r["arm"] == arm]
        reached = [steps_to(r["evals"], target) for r in runs]
        finals = [r["final"] for r in runs]
        kl = ", ".join(f"{a:.3f} -> {b:.3f}" for a, b in (r["reverse_kl"] for r in runs if r["reverse_kl"])) or "-"
        lines.append(
            f"| {arm} | {len(runs)} | {', '.join('never' if s is None else str(s) for s in reached)} | "
            f"**{100 * np.mean(finals):.1f}** ± {100 * np.std(finals):.1f} | {np.mean(finals) / teacher:.2f} | "
            f"{kl} | {np.mean([r['seconds'] for r in runs]):.0f} |"
        )
    lines += [
        "",
        "Per run (step: accuracy):",
        "- teacher: " + " ".join(f"{s}:{100 * a:.0f}" for s, a in result["teacher"]["evals"]),
    ]
    for r in result["runs"]:
        lines.append(f"- {r['arm']} seed {r['seed']}: " + " ".join(f"{s}:{100 * a:.0f}" for s, a in r["evals"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start-model", type=Path, required=True, help="the SFT checkpoint every run starts from")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "distill_demo")
    parser.add_argument("--save", action="store_true", help="record the result in bench/results/")
    args = parser.parse_args()
    args.start_model = args.start_model.resolve()
    run_and_record("distill_demo", args, run, report)


if __name__ == "__main__":
    main()
