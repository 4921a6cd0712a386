"""One torch.distributed world met through the name-resolve rendezvous (AREAL_HPC_RENDEZVOUS; no
MASTER_ADDR/PORT), with an MPI world in the same processes when asked. Each rank reports, as one JSON
line, its placement, role, threads and devices, the sums of gloo allreduces over every rank and over the
trainer ranks, and of an mpi4py allreduce. The line goes to stdout, or with ``--reports DIR`` to
DIR/rank<r>.json: mpirun forwards its ranks' stdout without keeping lines whole (two ranks' reports once
came as one line), and srun gathers every task's into one output file.

    RANK=r WORLD_SIZE=w AREAL_HPC_RENDEZVOUS=DIR python -m tests.rank_allreduce N_TRAINERS
    AREAL_HPC_RENDEZVOUS=DIR mpirun -np 2 python -m tests.rank_allreduce N_TRAINERS --mpi --reports OUT
    srun --mpi=pmix --het-group=0,1 python -m tests.rank_allreduce N_TRAINERS --mpi --reports OUT   (het job)
"""

import argparse
import dataclasses
import json
import os
from pathlib import Path

from areal_hpc.runtime.bootstrap import Placement, RoleTasks, assigned_devices, cpu_threads, task_role

placement = Placement.detect()  # before MPI_Init: from what the launcher set alone
parser = argparse.ArgumentParser()
parser.add_argument("n_trainers", type=int)
parser.add_argument("--mpi", action="store_true")
parser.add_argument("--reports", type=Path, help="write the report to DIR/rank<r>.json instead of stdout")
args = parser.parse_args()
n_trainers, with_mpi = args.n_trainers, args.mpi
report = {
    **dataclasses.asdict(placement),
    "threads": cpu_threads(),
    "devices": assigned_devices(placement.local_rank, 1),
}
role = task_role(placement, [RoleTasks("trainer", n_trainers), RoleTasks("rollout", placement.world - n_trainers)])
report["role"], report["index"] = role.role, role.index
if with_mpi:
    from mpi4py import MPI

    report["mpi_sum"] = MPI.COMM_WORLD.allreduce(placement.rank + 1)
    # Only PMIX_RANK left, as a PMIx launcher that names no world size would leave it: Placement asks mpi4py.
    pmix_only = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_COMM_WORLD_", "PMI_"))}
    report["via_mpi4py"] = dataclasses.asdict(Placement.detect(pmix_only))

import torch  # noqa: E402  (after MPI_Init, as a real MPI program would)
import torch.distributed as dist  # noqa: E402

from areal_hpc.parallel.mesh import init_distributed  # noqa: E402

rank, world = init_distributed(torch.device("cpu"), timeout_s=60)
everyone = torch.tensor([float(rank + 1)])
dist.all_reduce(everyone)
trainers = dist.new_group(list(range(n_trainers)))  # every rank takes part in creating a group
among_trainers = torch.tensor([float(rank + 1)])
if report["role"] == "trainer":
    dist.all_reduce(among_trainers, group=trainers)
report.update(torch_rank=rank, torch_world=world, torch_sum=everyone.item(), trainer_sum=among_trainers.item())
if args.reports is None:
    print(json.dumps(report), flush=True)
else:
    args.reports.mkdir(parents=True, exist_ok=True)
    (args.reports / f"rank{rank}.json").write_text(json.dumps(report))
dist.destroy_process_group()
if with_mpi:  # rank 0 hosts the rendezvous store: it leaves only once every rank has left its groups
    MPI.COMM_WORLD.Barrier()
