"""A rank for the mesh test: builds the trainer mesh of the layout in argv and writes, per named
sub-mesh, the global ranks of its own group to OUT.rank<r>.json.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.mesh_ranks OUT dp=2 tp=2 ...
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from areal_hpc.layout import ParallelDims
from areal_hpc.parallel.mesh import build_mesh, init_distributed

SUB_MESHES = ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp")


def main(out: str, sizes: list[str]) -> None:
    rank, _world = init_distributed(torch.device("cpu"))
    mesh = build_mesh(ParallelDims(**{k: int(v) for k, v in (s.split("=") for s in sizes)}), torch.device("cpu"))
    groups = {name: dist.get_process_group_ranks(mesh.group(name)) for name in SUB_MESHES}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(
            {"groups": groups, "coords": mesh.coords, "data_rank": mesh.data_rank, "leads_replica": mesh.leads_replica},
            f,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
