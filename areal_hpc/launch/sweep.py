"""``areal-hpc sweep``: a grid of runs as one Slurm job array (submitit), and the grid's results.

    areal-hpc sweep --config configs/quickstart.yaml [--name NAME] [--parallel N] [--wait] [key=value ...] \\
        sweep.actor.lr=[1e-4,3e-4] sweep.rollout.max_head_offpolicyness=[0,2,4]
    areal-hpc sweep --status <cluster.fileroot>/<experiment.name>/<sweep name> [--wait]

Every point of the cartesian product of the ``sweep.KEY=[...]`` lists (plain ``key=value`` items apply to
every point) is validated before anything is submitted. Each point is its own trial,
``experiment.trial=<sweep name>/<point name>``, run by one array element: a ``SweepTrial`` (submitit
``Checkpointable``) that runs the local launcher in its allocation with ``--resume=auto``. On SIGUSR2
the launcher has the trainer save, then submitit requeues the same call, which resumes. The sweep
folder holds ``sweep.json``, submitit's logs (``submitit/``) and, once every point has finished,
``results.csv``, ``results.md`` and ``results.png``.

Simplifications: an element is one task on one node of ``slurm.trainer.partition`` (trainer ranks and
rollout servers side by side, CPUs for all of them: the most any point needs); ``slurm.*`` settings
are shared by the whole array, so they cannot be swept.
"""

from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from functools import reduce
from pathlib import Path
from urllib.parse import quote

from areal_hpc.errors import UserError
from areal_hpc.fsio import atomic_write_json, atomic_write_text, read_json_lines
from areal_hpc.launch.slurm_options import extra_sbatch_options, slurm_minutes

SWEEP_FILE = "sweep.json"
# Short names of keys whose last segment is long; the paper calls the staleness bound eta.
SHORT_NAMES = {"rollout.max_head_offpolicyness": "eta"}
# Where the sweep and its runs live: the sweep sets them, so no point may change them.
PLACE_KEYS = ("experiment.name", "experiment.trial", "cluster.fileroot")
POLL_S = 2.0


def add_sweep_command(commands) -> None:
    """Register ``sweep`` on the ``areal-hpc`` subparsers object."""
    sweep = commands.add_parser("sweep", help="a grid of runs as one Slurm job array (submitit), and its results")
    sweep.add_argument("--config", metavar="FILE", help="experiment YAML (see configs/)")
    sweep.add_argument("--profile", metavar="FILE", help="site profile YAML under the config (e.g. slurm/profiles/dev.yaml)")
    sweep.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="config overrides for every point, and the grid: sweep.KEY=[v1,v2,...] per swept key")
    sweep.add_argument("--name", help="sweep name: its folder under <cluster.fileroot>/<experiment.name>/ "
                                      "(default: sweep-<date>-<time>)")
    sweep.add_argument("--parallel", type=int, metavar="N", help="array elements running at once (default: all)")
    sweep.add_argument("--status", metavar="DIR", help="the state of the sweep in DIR (a sweep folder) and, "
                                                      "when every point has finished, its results")
    sweep.add_argument("--wait", action="store_true", help="block (with a progress line) until every point finishes")
    sweep.set_defaults(handler=_sweep)


def _sweep(args) -> int:
    if args.status:
        if args.config or args.profile or args.overrides or args.name or args.parallel is not None:
            raise UserError("sweep --status DIR takes no --config, --profile, --name, --parallel or KEY=VALUE items")
        folder = Path(args.status)
    else:
        if not args.config:
            raise UserError("sweep needs --config FILE (or --status DIR to look at a submitted sweep)")
        folder = submit(args.config, args.overrides, args.name, args.parallel, args.profile)
        if not args.wait:
            return 0
    return report(folder, wait=args.wait)


# ---- the grid ----

@dataclass
class SweepPoint:
    name: str
    overrides: list[str]  # this point's own key=value items, as typed
    values: dict  # key -> value as the config holds it


def split_items(items: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """``key=value`` items into the overrides of every point and the swept ``(key, [value texts])``."""
    common, axes = [], {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key.startswith("sweep."):
            common.append(item)
            continue
        key = key.removeprefix("sweep.")
        texts = [t.strip() for t in value[1:-1].split(",")] if value.startswith("[") and value.endswith("]") else []
        if not sep or not texts or not all(texts):
            raise UserError(f"'{item}' is not of the form sweep.KEY=[v1,v2,...] (e.g. sweep.actor.lr=[1e-4,3e-4])")
        if key in axes:
            raise UserError(f"sweep.{key} is given twice; list all its values in one sweep.{key}=[...]")
        if key in PLACE_KEYS or key.startswith("slurm."):
            what = "slurm settings are shared by the whole job array" if key.startswith("slurm.") else \
                "the sweep sets where its runs live"
            raise UserError(f"sweep.{key} cannot be swept: {what}")
        axes[key] = texts
    for item in common:
        key = item.partition("=")[0]
        if key in axes:
            raise UserError(f"{key} is both swept (sweep.{key}=[...]) and fixed ({item}); keep one")
        if key == "experiment.trial":
            raise UserError("experiment.trial is set by the sweep (<sweep name>/<point name>); name the sweep "
                            "with --name")
    if not axes:
        raise UserError("sweep needs at least one sweep.KEY=[v1,v2,...] item (e.g. sweep.actor.lr=[1e-4,3e-4])")
    return common, list(axes.items())


def grid(config: str | list[str], common: list[str], axes: list[tuple[str, list[str]]]):
    """Every point of the grid, validated: ``[(SweepPoint, RunConfig)]``. Any bad point is a UserError
    naming it, before anything is submitted."""
    from areal_hpc.config import load_config

    keys = [key for key, _ in axes]
    points = []
    for texts in itertools.product(*(values for _, values in axes)):
        overrides = [f"{key}={text}" for key, text in zip(keys, texts)]
        try:
            cfg = load_config(config, [*common, *overrides])
        except UserError as exc:
            raise UserError(f"sweep point {','.join(overrides)}: {exc}") from None
        points.append((SweepPoint("", overrides, {key: _get(cfg, key) for key in keys}), cfg))
    for j, (key, texts) in enumerate(axes):  # [1e-4,0.0001] would be one run twice, in one folder
        value_of = {point.overrides[j].partition("=")[2]: point.values[key] for point, _ in points}
        seen = {}
        for text in texts:
            if value_of[text] in seen:
                raise UserError(f"sweep.{key}: {seen[value_of[text]]} and {text} are the same value; list it once")
            seen[value_of[text]] = text
    labels = _labels(keys)
    for point, _ in points:
        point.name = ",".join(f"{labels[k]}={_name_text(v)}" for k, v in point.values.items())
    return points


def _get(cfg, key: str):
    return reduce(getattr, key.split("."), cfg)


def _labels(keys: list[str]) -> dict[str, str]:
    """A point name's word per key: its short name or last segment, the full key where two would clash."""
    short = {key: SHORT_NAMES.get(key, key.rpartition(".")[2]) for key in keys}
    clash = {label for label in short.values() if list(short.values()).count(label) > 1}
    return {key: key if label in clash else label for key, label in short.items()}


def _name_text(value) -> str:
    """A value as it reads in a folder name: repr of numbers (0.0001), lower-case booleans, and text
    percent-encoded (so '/' cannot nest folders and two different values never give one name)."""
    text = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, float) else str(value)
    return quote(text, safe="._+-")


# ---- submission ----

def submit(config: str, items: list[str], name: str | None, parallel: int | None, profile: str | None = None) -> Path:
    """Validate the grid, submit it as one job array, write ``sweep.json``; returns the sweep folder.
    With a site ``profile``, the elements load the profile and the config merged into
    ``<sweep folder>/config.yaml``."""
    from areal_hpc.config import absolute_path_overrides, load_config, to_yaml

    config = str(Path(config).resolve())  # the array runs from wherever sbatch was called
    files = [str(Path(profile).resolve()), config] if profile else config
    common, axes = split_items(items)
    common = [*common, *absolute_path_overrides(load_config(files, common))]  # elements start elsewhere
    fileroot = Path(load_config(files, common).cluster.fileroot)
    name = name or f"sweep-{datetime.now():%Y%m%d-%H%M%S}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+=,-]*", name):
        raise UserError(f"--name {name!r}: use letters, digits and . _ + = , - (it names a folder)")
    points = grid(files, common, axes)
    if parallel is not None and parallel < 1:
        raise UserError(f"--parallel must be a positive number of array elements, got {parallel}")
    folder = fileroot / points[0][1].experiment.name / name
    if (folder / SWEEP_FILE).exists():
        raise UserError(f"{folder} already holds a sweep; choose another --name")
    for point, cfg in points:
        cfg.experiment.trial = f"{name}/{point.name}"
    executor = _executor(folder / "submitit", name, [cfg for _, cfg in points], parallel or len(points))
    if profile:
        folder.mkdir(parents=True, exist_ok=True)
        config = str(folder / "config.yaml")
        atomic_write_text(Path(config), to_yaml(load_config(files)))
    jobs = _submit_array(executor, config, [[*common, *p.overrides, f"experiment.trial={name}/{p.name}"]
                                            for p, _ in points])
    array = jobs[0].job_id.partition("_")[0]
    record = {"name": name, "config": config, "overrides": common, "array_job_id": array,
              "submitit_folder": str(executor.folder), "submitted": datetime.now().isoformat(timespec="seconds"),
              "points": [{"name": p.name, "overrides": p.overrides, "job_id": job.job_id, "run_dir": str(cfg.run_dir),
                          "total_steps": cfg.rl.total_train_steps} for (p, cfg), job in zip(points, jobs)]}
    atomic_write_json(folder / SWEEP_FILE, record)
    print(f"submitted sweep {name}: {len(points)} point{'s' * (len(points) > 1)} as Slurm job array {array} "
          f"({parallel or len(points)} at a time)\n  sweep folder: {folder}\n"
          f"  check it:     areal-hpc sweep --status {folder} [--wait]   (or: squeue -j {array})", flush=True)
    return folder


def _executor(folder: Path, name: str, cfgs: list, parallel: int):
    """submitit's Slurm executor for one array element: one task on one node of the trainer partition,
    with the CPUs of every process the local launcher starts there."""
    from submitit import SlurmExecutor

    slurm = cfgs[0].slurm
    cpus = max(c.slurm.trainer.cpus_per_task * c.rl.trainer_processes
               + c.slurm.rollout.cpus_per_server * c.rollout.n_servers for c in cfgs)
    extra = {"requeue": True, **extra_sbatch_options(slurm.extra_sbatch)}  # requeue: where JobRequeue=0 too
    if slurm.trainer.mem:
        extra["mem"] = slurm.trainer.mem  # submitit's own `mem` wants gigabytes as a number
    params = {"job_name": name, "partition": slurm.trainer.partition, "nodes": 1, "ntasks_per_node": 1,
              "cpus_per_task": cpus, "time": slurm_minutes(slurm.time), "signal_delay_s": slurm.signal_lead_s,
              "array_parallelism": parallel, "additional_parameters": extra}
    gpus = max(c.slurm.trainer.gpus_per_node + c.slurm.rollout.gpus_per_server * c.rollout.n_servers for c in cfgs)
    if gpus:  # the trainer ranks' and the rollout servers' accelerators, all on the element's node
        params["gres"] = f"{slurm.gres}:{gpus}"
    params.update({k: v for k, v in (("account", slurm.account), ("qos", slurm.qos)) if v})
    if "%j" in str(folder):
        raise UserError(f"the sweep folder {folder} must not contain %j")
    try:
        executor = SlurmExecutor(folder, max_num_timeout=slurm.max_requeues)
    except RuntimeError:
        raise UserError("srun not found: submit sweeps from a machine with the Slurm commands") from None
    executor.update_parameters(**params)
    return executor


def _submit_array(executor, config: str, overrides: list[list[str]]) -> list:
    from submitit.core.utils import FailedJobError

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's refusal: we say it in one line
            return executor.map_array(sys.modules[__name__].SweepTrial(), [config] * len(overrides), overrides)
    except FailedJobError as exc:  # sbatch refused it (a partition that does not exist, an account, ...)
        shutil.rmtree(executor.folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            executor.folder.parent.rmdir()  # the sweep folder, unless something else is in it
        lines = [line.removeprefix("sbatch: error: ") for line in str(exc).splitlines() if line.strip()]
        raise UserError(f"sbatch refused the job array: {lines[-1] if lines else exc}") from None


def _define_sweep_trial():
    from submitit.helpers import Checkpointable

    class SweepTrial(Checkpointable):
        """One array element: the local launcher in the element's allocation. ``resume="auto"`` continues
        what an earlier incarnation saved; submitit's default ``checkpoint`` (resubmit this same call)
        is the requeue, after the launcher had the trainer save on SIGUSR2."""

        def __call__(self, config: str, overrides: list[str]) -> str:
            from areal_hpc.config import load_config
            from areal_hpc.launch.local import launch

            code = launch(config, overrides, resume="auto")
            run_dir = load_config(config, overrides).run_dir
            if code:
                raise RuntimeError(f"the run in {run_dir} exited with code {code} (its logs: {run_dir / 'logs'})")
            return str(run_dir)

    SweepTrial.__module__, SweepTrial.__qualname__ = __name__, "SweepTrial"
    return SweepTrial


def __getattr__(name: str):
    """``SweepTrial`` is defined on first use (pickling the call, unpickling it in the job): it subclasses
    submitit's ``Checkpointable``, and importing submitit (asyncio, cloudpickle) with this module would
    slow every ``areal-hpc`` command, ``--help`` included."""
    if name != "SweepTrial":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = _define_sweep_trial()
    return globals()[name]


# ---- status and results ----

@dataclass
class PointState:
    name: str
    job_id: str
    state: str  # Slurm's, as sacct says it (through submitit)
    done: bool
    step: int | None  # last step in the run's metrics
    total_steps: int
    run_dir: Path


def point_states(record: dict) -> list[PointState]:
    """Each point's Slurm state (one sacct call for the whole array) and its last step."""
    from submitit import SlurmJob

    jobs = [SlurmJob(folder=record["submitit_folder"], job_id=p["job_id"]) for p in record["points"]]
    SlurmJob.watcher.update()
    states = []
    for point, job in zip(record["points"], jobs):
        state = job.watcher.get_state(job.job_id, mode="cache")
        ended_in_slurm = job.watcher.is_done(job.job_id, mode="cache")
        returned = job.paths.result_pickle.exists()
        if returned and not ended_in_slurm:  # Slurm's accounting lags the function's return by seconds
            state = state_from_result(job.paths.result_pickle)
        done = ended_in_slurm or returned
        run_dir = Path(point["run_dir"])
        step = max((r["step"] for r in read_metrics(run_dir)), default=None)
        states.append(PointState(point["name"], job.job_id, state, done, step, point["total_steps"], run_dir))
    return states


def state_from_result(result_pickle: Path) -> str:
    """COMPLETED or FAILED, from the outcome submitit pickled when the point's function returned."""
    from submitit.core.utils import pickle_load

    outcome, _ = pickle_load(result_pickle)
    return "COMPLETED" if outcome == "success" else "FAILED"


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``<run>/metrics.jsonl``, read as the trainer reads them back; none before it exists."""
    return read_json_lines(run_dir / "metrics.jsonl")


def point_result(state: PointState) -> dict:
    records = read_metrics(state.run_dir)
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    reward = [r["rollout/reward"] for r in records if "rollout/reward" in r]
    speed = [r["perf/trained_tokens_per_s_run"] for r in records if "perf/trained_tokens_per_s_run" in r]
    return {"point": state.name, "state": state.state, "final_eval_accuracy": accuracy[-1] if accuracy else None,
            "best_eval_accuracy": max(accuracy, default=None), "final_reward": reward[-1] if reward else None,
            "trained_tokens_per_s": speed[-1] if speed else None,
            "curve": [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]}


COLUMNS = {"point": "point", "final_eval_accuracy": "final eval acc", "best_eval_accuracy": "best eval acc",
           "final_reward": "final reward", "trained_tokens_per_s": "trained tok/s", "state": "state"}


def _cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key.endswith("accuracy"):
        return f"{value:.1%}"
    return f"{value:.3f}" if key == "final_reward" else f"{value:.0f}" if key == "trained_tokens_per_s" else str(value)


def write_results(folder: Path, name: str, results: list[dict]) -> str:
    """results.csv, results.md and results.png in the sweep folder; returns the table as text."""
    rows = [[_cell(k, r[k]) for k in COLUMNS] for r in results]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    writer.writerows([[r[k] for k in COLUMNS] for r in results])
    (folder / "results.csv").write_text(buffer.getvalue())
    (folder / "results.md").write_text("\n".join(["| " + " | ".join(row) + " |" for row in
                                                  [list(COLUMNS.values()), ["---"] * len(COLUMNS), *rows]]) + "\n")
    _plot(folder / "results.png", name, results)
    widths = [max(len(row[i]) for row in [list(COLUMNS.values()), *rows]) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in [list(COLUMNS.values()), *rows])


def _plot(out: Path, name: str, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for result in results:
        if result["curve"]:
            steps, values = zip(*result["curve"])
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=result["point"])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("step")
    ax.set_ylabel("eval accuracy")
    ax.set_title(f"sweep {name}: eval accuracy")
    ax.grid(alpha=0.3)
    if any(r["curve"] for r in results):
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def report(folder: Path, wait: bool = False) -> int:
    """Print each point's state; once all have finished, the results table (and write its files).
    Exit code 1 when a point did not complete."""
    try:
        record = json.loads((folder / SWEEP_FILE).read_text())
    except FileNotFoundError:
        raise UserError(f"{folder} is not a sweep folder (no {SWEEP_FILE}); it is "
                        f"<cluster.fileroot>/<experiment.name>/<sweep name>") from None
    states = _wait(record) if wait else point_states(record)
    finished = sum(s.done for s in states)
    print(f"sweep {record['name']}: job array {record['array_job_id']}, {finished}/{len(states)} points finished")
    width = max(len(s.name) for s in states)
    for s in states:
        step = "-" if s.step is None else s.step
        print(f"  {s.name:<{width}}  {s.job_id:<12} {s.state:<12} step {step}/{s.total_steps}")
    if finished < len(states):
        return 0
    results = sorted((point_result(s) for s in states),
                     key=lambda r: -1 if r["final_eval_accuracy"] is None else r["final_eval_accuracy"], reverse=True)
    table = write_results(folder, record["name"], results)
    print(f"\n{table}\n\nwrote results.csv, results.md, results.png in {folder}")
    return 0 if all(s.state == "COMPLETED" for s in states) else 1


def _wait(record: dict) -> list[PointState]:
    """Poll until every point has finished, with a progress line (points finished, running, steps)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn(f"[bold]sweep {record['name']}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.fields[line]}"), console=Console(stderr=True))
    with progress:
        bar = progress.add_task("points", total=len(record["points"]), line="")
        while True:
            states = point_states(record)
            running = sum(s.state == "RUNNING" for s in states)
            steps = sum(s.step or 0 for s in states)
            progress.update(bar, completed=sum(s.done for s in states),
                            line=f"running {running}  steps {steps}/{sum(s.total_steps for s in states)}")
            if all(s.done for s in states):
                return states
            time.sleep(POLL_S)
