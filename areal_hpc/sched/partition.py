"""Device splits between training and rollout for a target training compute share γ.

``metis_split`` is AReaL-Hex's graph partition: machines are vertices weighted by compute, links
are edges weighted by bandwidth, and METIS cuts the cheapest links so that training gets a share γ
of the compute. ``ratio_split`` is the second seed the refinement starts from: training takes the
devices with the most FLOP/s per HBM byte/s first, the kind of device that suits it.
"""

from __future__ import annotations

import pymetis

from areal_hpc.sched.hardware import Cluster


def metis_split(cluster: Cluster, share: float) -> dict[str, int]:
    """Training devices per pool when METIS gives training ``share`` of the compute (whole machines)."""
    machines = [pool for pool in cluster.pools for _ in range(pool.nodes)]
    if share <= 0 or share >= 1 or len(machines) < 2:
        return {pool.name: pool.devices if share >= 0.5 else 0 for pool in cluster.pools}
    xadj, adjncy, eweights = [0], [], []
    for i, a in enumerate(machines):
        for j, b in enumerate(machines):
            if i != j:
                adjncy.append(j)
                eweights.append(max(1, round(10 * cluster.bandwidth(a.name, b.name))))
        xadj.append(len(adjncy))
    vweights = [max(1, round(p.per_node * p.device.tflops)) for p in machines]
    _, parts = pymetis.part_graph(
        2, pymetis.CSRAdjacency(xadj, adjncy), vweights=vweights, eweights=eweights, tpwgts=[share, 1 - share]
    )
    counts = {pool.name: 0 for pool in cluster.pools}
    for machine, part in zip(machines, parts):
        if part == 0:
            counts[machine.name] += machine.per_node
    return counts


def ratio_split(cluster: Cluster, share: float) -> dict[str, int]:
    """Training devices per pool, filled from the most compute-heavy device type until ``share``."""
    total = sum(p.devices * p.device.tflops for p in cluster.pools)
    counts, taken = {pool.name: 0 for pool in cluster.pools}, 0.0
    for pool in sorted(cluster.pools, key=lambda p: p.device.tflops / p.device.hbm_gbs, reverse=True):
        want = round((share * total - taken) / pool.device.tflops)
        counts[pool.name] = max(0, min(pool.devices, want))
        taken += counts[pool.name] * pool.device.tflops
    return counts
