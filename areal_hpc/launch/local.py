"""The local launcher behind ``areal-hpc train``: every process of an RL run on this machine.

    areal-hpc train --config configs/quickstart.yaml [--resume[=auto]] [key=value ...]

1. the starting model: ``model.path``, or a fresh ``model.preset`` written into the run folder;
2. on a fresh run with ``rl.sft_warmup_steps``: SFT warm-up (``areal-hpc sft``) into ``<run>/sft_warmup``
   (on the CPU a fork of the fork server, which is closed while it runs: ``roles.run_stage``);
3. ``rollout.n_servers`` rollout servers (``areal-hpc serve``) and ``rl.trainer_processes`` trainer ranks
   (torch.distributed, rank 0 drives and prints progress), started together: the servers load while the
   trainers set up (not during the warm-up, whose peak they would add to).
(the roles and their commands live in ``roles.py``, shared with the Slurm launcher). It stops them all
when the run ends, fails, or is interrupted; children die with it even on SIGKILL. SIGUSR2 makes the
trainer save and stop, then the job is requeued when it runs under Slurm (``preemption.py``). CPU cores
are dealt out disjointly to servers and trainer ranks (``core_shares``: each process pinned to its own),
so neither starves the other, and so are listed accelerators (CUDA_VISIBLE_DEVICES,
ASCEND_RT_VISIBLE_DEVICES; ``device_shares``). Trainer rank 0 runs its update on its own cores and its
rollout side (controller, client, rewards, shard commits) on the servers' or its own, whichever is free
(``train/demo_tuning.py``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from areal_hpc.config import RunConfig, load_config
from areal_hpc.errors import UserError
from areal_hpc.launch.preemption import StopForwarder
from areal_hpc.launch.roles import (
    FORK_SERVER_PRELOAD,
    config_args,
    forget_other_incarnations,
    incarnation_folder,
    prepare_start_model,
    server_command,
    trainer_command,
)
from areal_hpc.resolve import Host, resolve
from areal_hpc.runtime.bootstrap import (
    INCARNATION,
    LAUNCHED_AT,
    RENDEZVOUS,
    RUN_MARKER,
    TRAINERS_AT,
    allocator_env,
    cpu_threads,
    new_incarnation,
)
from areal_hpc.runtime.forkserver import Forker
from areal_hpc.runtime.name_resolve import ROLLOUT_SERVERS
from areal_hpc.runtime.run_state import SAVED_AND_STOPPED, latest_checkpoint, previous_run
from areal_hpc.runtime.supervisor import SupervisedProcess
from areal_hpc.train.demo_tuning import rollout_side_env
from areal_hpc.train.failure_report import last_summary
from areal_hpc.train.task_setup import check_inputs


def should_resume(cfg: RunConfig, resume: str) -> bool:
    """Whether this launch continues the run in ``cfg.run_dir``: ``always`` (``--resume``) needs one,
    ``never`` refuses to replace one, ``auto`` (a requeued or restarted job) continues one if there is
    one and starts otherwise. A fresh run never mixes with an old one's outputs (``previous_run``); a run
    killed before its first checkpoint resumes from step 0 and trains what it had stored."""
    found = previous_run(cfg.run_dir)
    if resume == "always" and not found:
        raise UserError(
            f"--resume: nothing to resume in {cfg.run_dir} (no run has started there); "
            f"run without --resume to start, or with --resume=auto"
        )
    if resume == "never" and found:
        saved = latest_checkpoint(cfg.run_dir)
        since = f"from {saved.name}" if saved is not None else "from step 0, with the episodes it stored"
        raise UserError(
            f"{cfg.run_dir} already holds a run ({', '.join(found)}); pass --resume to continue it ({since}), "
            f"or choose another experiment.trial=NAME"
        )
    return bool(found)


def launch(config: str, overrides: list[str], resume: str = "never") -> int:
    cfg = resolve(load_config(config, overrides), Host.probe()).cfg  # every process runs on this node
    check_inputs(cfg)  # your data, reward and workflow load; the teacher answers; LoRA's targets exist
    resume = should_resume(cfg, resume)
    run_dir = cfg.run_dir
    incarnation = f"{new_incarnation()}.{os.getpid()}"  # two launches inside one Slurm allocation differ too
    shutil.rmtree(run_dir / "name_resolve" / ROLLOUT_SERVERS, ignore_errors=True)  # addresses of a killed run
    forget_other_incarnations(run_dir, incarnation)
    env = {
        RUN_MARKER: str(run_dir.resolve()),
        LAUNCHED_AT: str(time.time()),
        INCARNATION: incarnation,
        RENDEZVOUS: str(incarnation_folder(run_dir, incarnation) / "trainer"),
        "HF_HUB_OFFLINE": "1",
        **allocator_env(),
    }
    args = config_args(config, overrides)
    started: list[SupervisedProcess] = []
    trainer_devices, server_devices = device_shares(cfg)
    trainer_cores, server_cores = core_shares(cfg, sorted(os.sched_getaffinity(0)), cpu_threads())
    if server_cores[0].cores:
        print(
            "cores: "
            + ", ".join(
                [f"rollout server {i} on {p.cores}" for i, p in enumerate(server_cores)]
                + [f"trainer rank {i} on {p.cores}" for i, p in enumerate(trainer_cores)]
            )
        )

    fork_server = Forker(env, FORK_SERVER_PRELOAD).start() if forks_processes(cfg) else None

    def start(name: str, command: list[str], log: Path | None, cores: CoreShare, extra_env: dict) -> SupervisedProcess:
        process = SupervisedProcess(
            name,
            command,
            log,
            {**env, "OMP_NUM_THREADS": str(cores.threads), **extra_env},
            cores=cores.cores,
            fork_server=fork_server,
        )
        started.append(process.start())
        return process

    def on_sigterm(signum, frame) -> None:
        """Trainer rank 0 saves first (the other processes are stopped after it); before the trainers
        start, or on a second SIGTERM, the launch just ends (``finally`` stops the children)."""
        driver = next((proc for proc in started if proc.name == "trainer rank 0"), None)
        if driver is None or driver.process.poll() is not None or terminating:
            sys.exit(143)
        terminating.append(signum)
        driver.process.send_signal(signal.SIGTERM)

    terminating: list[int] = []
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    memory = RunMemory(env[RUN_MARKER])
    with StopForwarder() as stop_warning:
        try:
            # the warm-up is trainer rank 0's work: its threads, not every core (on a busy 2-core machine two
            # OpenMP threads spin against the other processes: SFT steps took ~7 s with 2 threads, ~1 s with 1)
            warm_up_env = {
                **env,
                "OMP_NUM_THREADS": str(trainer_cores[0].threads),
            }  # servers' allocator defaults: its shapes vary
            start_model = prepare_start_model(cfg, args, warm_up_env, fork_server=fork_server)
            for i in range(cfg.rollout.n_servers):
                start(
                    f"rollout server {i}",
                    server_command(args, start_model),
                    run_dir / "logs" / f"rollout-server-{i}.log",
                    server_cores[i],
                    server_devices[i],
                )
            env[TRAINERS_AT] = str(time.time())
            rollout_side = rollout_side_env([share.cores for share in server_cores], trainer_cores[0].cores)
            for rank in range(cfg.rl.trainer_processes):
                start(
                    f"trainer rank {rank}",
                    trainer_command(args, start_model, resume),
                    None if rank == 0 else run_dir / "logs" / f"trainer-rank-{rank}.log",
                    trainer_cores[rank],
                    {
                        "RANK": str(rank),
                        "LOCAL_RANK": str(rank),
                        "WORLD_SIZE": str(cfg.rl.trainer_processes),
                        **trainer_devices[rank],
                        **(rollout_side if rank == 0 else {}),
                        **allocator_env(tree_trainer=cfg.actor.tree_training == "dta"),
                    },
                )
            if fork_server is not None:  # every process is started: its pages no child shares are freed
                fork_server.close()
            trainers = started[-cfg.rl.trainer_processes :]
            stop_warning.set_target(trainers[0].process.pid)
            code = _supervise(started[: -cfg.rl.trainer_processes], trainers, stop_warning)
            print(f"peak memory of the run's processes: {memory.peak / 2**30:.2f} GiB (PSS, sampled every second)")
            summary = last_summary(run_dir) if code == cfg.rollout.failure_budget.exit_code_on_failures else None
            if code and summary:  # the run's last line stays its result
                print(f"areal-hpc: {summary}", file=sys.stderr)
        finally:
            for proc in reversed(started):
                proc.stop(grace_s=10)
            memory.stop()
            if fork_server is not None:
                fork_server.close()
            signal.signal(signal.SIGTERM, previous)
        if code == SAVED_AND_STOPPED and not stop_warning.requeue():
            again = shlex.join(["areal-hpc", "train", "--config", config, *overrides, "--resume"])
            print(f"areal-hpc: stopped on request; continue with: {again}", file=sys.stderr)
    return code


def forks_processes(cfg: RunConfig) -> bool:
    """Whether rollout servers and trainer ranks start as forks of one preloaded interpreter
    (``cluster.fork_server``): only on the CPU (``cfg`` resolved), where no accelerator may be initialised
    before a fork."""
    return cfg.cluster.fork_server and cfg.cluster.device == "cpu"


class RunMemory:
    """Peak proportional set size (shared pages split between sharers) of every process of one run,
    this launcher included, sampled every second from the launch on by a background thread."""

    def __init__(self, run: str):
        self.marker, self.peak = f"{RUN_MARKER}={run}".encode(), 0
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="run-memory", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(1.0):
            self.sample()

    def sample(self) -> None:
        total = 0
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and (
                    int(proc.name) == os.getpid() or self.marker in (proc / "environ").read_bytes().split(b"\0")
                ):
                    rollup = (proc / "smaps_rollup").read_text().split("\nPss:")[1]
                    total += int(rollup.split()[0]) * 1024
            except (OSError, IndexError):
                continue  # exited meanwhile, or a kernel without smaps_rollup
        self.peak = max(self.peak, total)


@dataclass(frozen=True)
class CoreShare:
    threads: int  # OMP_NUM_THREADS of the process
    cores: list[int] | None = None  # the CPU cores it is pinned to; None: not pinned


def core_shares(
    cfg: RunConfig, cores: list[int], threads: int | None = None
) -> tuple[list[CoreShare], list[CoreShare]]:
    """CPU cores of the trainer ranks and of the rollout servers, as on a cluster where their devices are
    disjoint: ``rollout.cores_per_server`` for each server (0: an even split of all processes), the rest
    dealt out to the trainer ranks. Not pinned (threads only, the same even split) with
    ``cluster.pin_cores=false``, or when there are fewer cores than processes or too few for the asked
    server cores. ``threads`` is the allocation's CPU count where it differs from the visible cores."""
    trainers, servers = cfg.rl.trainer_processes, cfg.rollout.n_servers
    available = threads or len(cores)
    even = max(1, available // (trainers + servers))
    per_server = cfg.rollout.cores_per_server or even
    left = len(cores) - servers * per_server
    if not cfg.cluster.pin_cores or threads not in (None, len(cores)) or left < trainers:
        return [CoreShare(even)] * trainers, [CoreShare(even)] * servers
    server_sets = [cores[i * per_server : (i + 1) * per_server] for i in range(servers)]
    rest = cores[servers * per_server :]
    trainer_sets = [rest[rank * len(rest) // trainers : (rank + 1) * len(rest) // trainers] for rank in range(trainers)]
    return ([CoreShare(len(c), c) for c in trainer_sets], [CoreShare(len(c), c) for c in server_sets])


DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")


def device_shares(cfg: RunConfig, environ=os.environ) -> tuple[list[dict], list[dict]]:
    """Disjoint accelerators, as on a cluster: one per trainer rank, ``rollout.tp_size`` per server, taken
    in order from the listed visible devices (an allocation's GRES). With no list, on the CPU, or with
    too few devices to split, every process sees what this one sees (and ranks pick by LOCAL_RANK)."""
    name = next((v for v in DEVICE_VARIABLES if environ.get(v)), None)
    trainers, servers, per_server = cfg.rl.trainer_processes, cfg.rollout.n_servers, cfg.rollout.tp_size
    if name is None or cfg.cluster.device == "cpu" or len(environ[name].split(",")) < trainers + servers * per_server:
        return [{}] * trainers, [{}] * servers
    devices = environ[name].split(",")
    shares = [devices[i : i + 1] for i in range(trainers)]
    shares += [devices[trainers + i * per_server : trainers + (i + 1) * per_server] for i in range(servers)]
    env = [{v: ",".join(share) for v in DEVICE_VARIABLES} for share in shares]
    return env[:trainers], env[trainers:]


def _supervise(servers: list[SupervisedProcess], trainers: list[SupervisedProcess], stop_warning: StopForwarder) -> int:
    """Wait for trainer rank 0 (the driver) and return its exit code (128 + N after signal N). A
    server that exits, or another rank that fails, ends the run with code 1; other ranks exit cleanly
    just before rank 0 when it tells them to stop. Rank 0 prints its own errors."""
    driver = trainers[0]
    while True:
        stop_warning.poke()
        code = driver.process.poll()
        if code is not None:
            if code < 0:
                print(f"areal-hpc: error: {driver.name} was killed by signal {-code}", file=sys.stderr)
            return 128 - code if code < 0 else code
        for proc in servers + trainers[1:]:
            code = proc.process.poll()
            if code is not None and (code or proc in servers):
                print(f"areal-hpc: error: {proc.failure(f'exited with code {code} during the run')}", file=sys.stderr)
                return 1
        time.sleep(0.2)
