"""Where a process sits in its job (rank, world, local rank, node, threads, devices) and the address
other nodes reach it at, read from what its launcher set: a Slurm step (het steps included), MPI,
torchrun or our local launcher; and the variables our launchers set for every role. Read by roles,
written by launchers; nothing here imports torch or either side.

What Slurm 22.05 sets, observed on the dev cluster (``slurm/dev/up.sh``):

- in a step (``srun``): ``SLURM_STEP_ID``, ``SLURM_PROCID`` (rank in the step), ``SLURM_STEP_NUM_TASKS``,
  ``SLURM_LOCALID``, ``SLURMD_NODENAME``. The batch script itself has ``SLURM_PROCID=0`` and its
  component's ``SLURM_NTASKS`` but no ``SLURM_STEP_ID``: it is one process, not rank 0 of a world.
- in a step over every component of a het job (``srun --het-group=0,1``): ``SLURM_PROCID`` runs over
  the whole step, component by component (component 0 first), ``SLURM_NTASKS`` and
  ``SLURM_STEP_NUM_TASKS`` are the total, ``SLURM_HET_SIZE`` the number of components,
  ``SLURM_NTASKS_HET_GROUP_<g>`` and ``SLURM_CPUS_PER_TASK_HET_GROUP_<g>`` each component's; there is
  no ``SLURM_CPUS_PER_TASK`` and no variable naming the task's component, and ``SLURM_JOB_PARTITION``
  is the last component's on every rank. ``PMIX_RANK`` (with ``--mpi=pmix``) equals ``SLURM_PROCID``.
- in a step over one component (``--het-group=1``): ranks from 0, that component's ``SLURM_NTASKS``,
  still ``SLURM_HET_SIZE`` and no ``SLURM_CPUS_PER_TASK``; ``SLURM_JOB_NODELIST`` is the component's.
- GRES: ``CUDA_VISIBLE_DEVICES`` lists the node's GPUs of the step for every task; with
  ``--gpus-per-task`` or ``--gpu-bind`` each task sees only its own, and ``SLURM_GPUS_ON_NODE`` stays
  the node's count.
- ``mpirun`` (Open MPI 4.1) sets ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK`` and ``PMIX_RANK``;
  under ``srun --mpi=pmix`` only ``PMIX_RANK`` is there when the program starts.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass

from areal_hpc.errors import UserError

RUN_MARKER = "AREAL_HPC_RUN"  # in every child's environment: which run a process belongs to
LAUNCHED_AT = "AREAL_HPC_LAUNCHED_AT"  # wall-clock time of the launch
TRAINERS_AT = "AREAL_HPC_TRAINERS_AT"  # wall-clock start of the trainer ranks (after any SFT warm-up)
INCARNATION = "AREAL_HPC_INCARNATION"  # unique per launch of a run (see ``new_incarnation``)
RENDEZVOUS = "AREAL_HPC_RENDEZVOUS"  # shared folder where trainer rank 0 publishes its store's host:port
INTERFACE = "AREAL_HPC_INTERFACE"  # network interface other nodes reach this one through (cluster.interface)

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_ROUTE_PROBE = ("198.51.100.1", 9)  # a documentation address: connecting a UDP socket only looks up the route


@dataclass(frozen=True)
class Placement:
    """Where this process sits in its job's whole world (every het component of the step)."""

    rank: int
    world: int
    local_rank: int
    node: str
    source: str  # "slurm" | "mpi" | "local"

    @classmethod
    def detect(cls, environ: Mapping[str, str] = os.environ) -> Placement:
        """The innermost launcher wins: torchrun or our local launcher (RANK, WORLD_SIZE), even inside
        an srun step; then mpirun's ranks (srun may have started its daemons, so SLURM_PROCID there
        counts nodes); then the Slurm step; nothing set: rank 0 of 1."""
        node = environ.get("SLURMD_NODENAME") or socket.gethostname()
        if "RANK" in environ and "WORLD_SIZE" in environ:
            found = cls(
                _int(environ, "RANK"), _int(environ, "WORLD_SIZE"), _int(environ, "LOCAL_RANK", 0), node, "local"
            )
        elif "OMPI_COMM_WORLD_RANK" in environ:  # Open MPI's mpirun
            found = cls(
                _int(environ, "OMPI_COMM_WORLD_RANK"),
                _int(environ, "OMPI_COMM_WORLD_SIZE"),
                _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
                node,
                "mpi",
            )
        elif "PMI_RANK" in environ and "PMI_SIZE" in environ:  # MPICH and Intel MPI (hydra)
            found = cls(
                _int(environ, "PMI_RANK"), _int(environ, "PMI_SIZE"), _int(environ, "MPI_LOCALRANKID", 0), node, "mpi"
            )
        elif "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ:  # srun, with --mpi=pmix and het steps
            world = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
            found = cls(
                _int(environ, "SLURM_PROCID"), _int(environ, world), _int(environ, "SLURM_LOCALID", 0), node, "slurm"
            )
        elif "PMIX_RANK" in environ:  # a PMIx launcher that names no world size: ask MPI itself
            found = cls._from_mpi(node)
        else:
            found = cls(0, 1, 0, node, "local")
        if not 0 <= found.rank < found.world:
            raise UserError(f"rank {found.rank} is outside a world of {found.world} (from {found.source} variables)")
        return found

    @classmethod
    def _from_mpi(cls, node: str) -> Placement:
        try:
            from mpi4py import MPI
        except ImportError:
            raise UserError(
                "PMIX_RANK is set but no world size: install mpi4py (pip install 'areal-hpc[mpi]') "
                "so the ranks can ask MPI"
            ) from None
        world = MPI.COMM_WORLD
        on_node = world.Split_type(MPI.COMM_TYPE_SHARED)  # collective: every rank of the world detects
        try:
            return cls(world.Get_rank(), world.Get_size(), on_node.Get_rank(), node, "mpi")
        finally:
            on_node.Free()


@dataclass(frozen=True)
class RoleTasks:
    """Consecutive global ranks of one role: ``tasks`` trainer ranks or rollout servers, ``accelerators``
    each; a server group's ``tp`` is each server's tensor-parallel size."""

    role: str  # "trainer" or "rollout"
    tasks: int
    accelerators: int = 0
    tp: int = 1


@dataclass(frozen=True)
class TaskRole:
    """What one task of the job is: its role, its index among that role's tasks, its accelerators (the
    node's visible ones from ``first_accelerator``) and, for a server, its tensor-parallel size."""

    role: str
    index: int
    accelerators: int
    first_accelerator: int
    tp: int


def task_role(placement: Placement, groups: list[RoleTasks]) -> TaskRole:
    """This task's role from ``groups``, the job's tasks in global-rank order. A node's tasks are
    consecutive ranks (Slurm's block distribution, within each het component), so a task's accelerators
    follow those of the node's tasks before it."""
    if sum(g.tasks for g in groups) != placement.world:
        layout = " + ".join(f"{g.tasks} {g.role}" for g in groups)
        raise UserError(f"the job's task groups ({layout}) do not add up to its world of {placement.world} processes")
    per_rank = [g for g in groups for _ in range(g.tasks)]
    mine = per_rank[placement.rank]
    node_start = placement.rank - placement.local_rank
    return TaskRole(
        mine.role,
        sum(g.role == mine.role for g in per_rank[: placement.rank]),
        mine.accelerators,
        sum(g.accelerators for g in per_rank[node_start : placement.rank]),
        mine.tp,
    )


def het_component(environ: Mapping[str, str] = os.environ) -> int | None:
    """Which het component this task belongs to; None outside a het job or in a step over some but
    not all components (Slurm names the component nowhere: see the module docstring)."""
    if "SLURM_HET_SIZE" not in environ or "SLURM_PROCID" not in environ:
        return None
    counts = [_int(environ, f"SLURM_NTASKS_HET_GROUP_{g}") for g in range(_int(environ, "SLURM_HET_SIZE"))]
    if _int(environ, "SLURM_STEP_NUM_TASKS", -1) == sum(counts):  # the step spans every component
        rank = _int(environ, "SLURM_PROCID")
        for g, count in enumerate(counts):
            if rank < count:
                return g
            rank -= count
    own = [
        g
        for g in range(len(counts))
        if environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{g}") == environ.get("SLURM_JOB_NODELIST")
    ]
    return own[0] if len(own) == 1 else None


def cpu_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """CPU threads this task was given (``--cpus-per-task``, per component in a het job), or None."""
    if "SLURM_CPUS_PER_TASK" in environ:
        return _int(environ, "SLURM_CPUS_PER_TASK")
    component = het_component(environ)
    key = f"SLURM_CPUS_PER_TASK_HET_GROUP_{component}"
    return _int(environ, key) if component is not None and key in environ else None


# Host-memory settings of every process a launcher starts, unless the user's environment sets them. glibc
# gives each thread that allocates its own 64 MB heap (a rollout server held 6 of them, 255 MB), and
# oneDNN keeps up to 1024 primitives (~0.3 MB each), one per matmul shape, whose rows varied from step
# to step: together 1.1 of the quickstart's 2.1 GiB. A tree-training trainer keeps 256: tree training pads
# its rows to multiples of 64 (``models.segment_forward.ROWS_MULTIPLE``), so a bf16 update's ~100 shapes
# recur, and holding 16 rebuilds most of them every step (~1 ms each: 256 shortens the quickstart's tree
# pass by about a fifth for ~0.1 GiB more peak PSS, bench/results/rl_step-primitives-rollout-side-*.md).
# Packed micro-batches (``actor.tree_training=off``) have as many rows as the batch has tokens, new every
# step: 256 then held primitives that never recur (the calculator agent's trainer: +0.25 GiB PSS,
# bench/results/run_memory-calculator-2026-12-06.md), so that trainer keeps 16.
ALLOCATOR_DEFAULTS = {"MALLOC_ARENA_MAX": "2", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16"}
TRAINER_ALLOCATOR_DEFAULTS = {**ALLOCATOR_DEFAULTS, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}


def allocator_env(environ: Mapping[str, str] = os.environ, tree_trainer: bool = False) -> dict[str, str]:
    """``ALLOCATOR_DEFAULTS`` (a ``tree_trainer``'s, a trainer rank with ``actor.tree_training=dta``:
    ``TRAINER_ALLOCATOR_DEFAULTS``) the user's environment does not already set."""
    defaults = TRAINER_ALLOCATOR_DEFAULTS if tree_trainer else ALLOCATOR_DEFAULTS
    return {name: value for name, value in defaults.items() if name not in environ}


def assigned_devices(first: int, count: int, environ: Mapping[str, str] = os.environ) -> list[str]:
    """This task's accelerators as Slurm's GRES set them: entries [first, first + count) of
    CUDA_VISIBLE_DEVICES (ASCEND_RT_VISIBLE_DEVICES on NPU), or the first ``count`` when Slurm bound each
    task its own. Without either variable every device is visible, numbered from 0."""
    name = "ASCEND_RT_VISIBLE_DEVICES" if "ASCEND_RT_VISIBLE_DEVICES" in environ else "CUDA_VISIBLE_DEVICES"
    if name not in environ:
        return [str(i) for i in range(first, first + count)]
    visible = [d for d in environ[name].split(",") if d]
    if _int(environ, "SLURM_GPUS_ON_NODE", 0) > len(visible):  # --gpus-per-task / --gpu-bind: ours alone
        first = 0
    if first + count > len(visible):
        node = environ.get("SLURMD_NODENAME") or socket.gethostname()
        raise UserError(
            f"this task needs accelerators {first}..{first + count - 1} but node {node} "
            f"shows {len(visible)} ({name}={environ[name]!r}); request at least "
            f"{first + count} per node (--gres=gpu:N) or start fewer tasks per node"
        )
    return visible[first : first + count]


def node_address(interface: str = "", environ: Mapping[str, str] = os.environ) -> str:
    """The address other nodes reach this process at.

    The IPv4 of ``interface`` when given; else the Slurm node name or the host name when it resolves to
    a non-loopback address; else the IPv4 of the interface holding the default route (Debian maps the
    host name to 127.0.1.1; on the dev cluster ``train1``/``rollout1`` do not resolve and the host name
    maps to 127.0.0.1 only, so its eth0 address is used). Loopback only when the machine has no route
    at all, where no other node could reach it anyway.
    """
    if interface:
        return interface_address(interface)
    names = [n for n in (environ.get("SLURMD_NODENAME"), socket.gethostname()) if n]
    for name in names:
        if any(not ip.is_loopback for ip in _resolve(name)):
            return name
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(_ROUTE_PROBE)
            return probe.getsockname()[0]
    except OSError:  # no route: this machine talks only to itself
        return next((n for n in names if _resolve(n)), "127.0.0.1")


def interface_address(interface: str) -> str:
    """The IPv4 address of a network interface; a UserError naming the interfaces there are otherwise."""
    names = [name for _, name in socket.if_nameindex()]
    if interface not in names:
        raise UserError(
            f"network interface {interface!r} does not exist on {socket.gethostname()} "
            f"(cluster.interface; there are: {', '.join(names)})"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            raise UserError(
                f"network interface {interface!r} has no IPv4 address (cluster.interface; "
                f"there are: {', '.join(names)})"
            ) from None
    return socket.inet_ntoa(raw[20:24])


def new_incarnation(environ: Mapping[str, str] = os.environ) -> str:
    """A name for this launch of a run, for INCARNATION: the Slurm job and its restart count (a
    requeued job keeps its id), else the launch time."""
    if "SLURM_JOB_ID" in environ:
        return f"{environ['SLURM_JOB_ID']}.{environ.get('SLURM_RESTART_COUNT', '0')}"
    return f"local.{time.time_ns()}"


def _resolve(name: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in socket.getaddrinfo(name, None)]
    except (socket.gaierror, UnicodeError):
        return []


def _int(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = environ.get(key)
    if value is None:
        if default is None:
            raise UserError(f"{key} is not set, but the launcher's other variables say it should be")
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{key}={value!r} is not an integer") from None
