"""Accelerator catalogue and cluster specs: what a planner may place work on, and what it costs.

A cluster YAML lists node pools (a name, a device type, nodes, devices per node, and the Slurm
partition that holds them) and the bandwidth between machines for every pair of pools. The shipped
catalog (areal_hpc/sched/catalog/clusters/) holds the papers' clusters and an example site; ``--cluster``
takes one of their names or a path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

from areal_hpc.errors import UserError, closest
from areal_hpc.sched.catalog import CLUSTERS, cluster_names


@dataclass(frozen=True)
class Accelerator:
    """One device type: dense bf16 TFLOP/s, HBM bandwidth (GB/s) and size (GB), intra-node link (GB/s), $/h."""

    name: str
    tflops: float
    hbm_gbs: float
    memory_gb: float
    link_gbs: float
    price_per_hour: float


# Vendor datasheet figures (dense bf16, no sparsity). H800 and H20 prices and link speeds are the
# AReaL-Hex paper's; the other prices are typical 2025 cloud list prices, to be overridden per site.
CATALOGUE = {
    a.name: a
    for a in [
        Accelerator("H100", 989.0, 3350.0, 80.0, 450.0, 6.00),
        Accelerator("H200", 989.0, 4800.0, 141.0, 450.0, 7.00),
        Accelerator("H800", 989.0, 3350.0, 80.0, 200.0, 5.28),
        Accelerator("H20", 148.0, 4000.0, 96.0, 450.0, 1.85),
        Accelerator("A100", 312.0, 2039.0, 80.0, 300.0, 2.50),
        Accelerator("L40S", 362.0, 864.0, 48.0, 32.0, 1.20),
        Accelerator("Ascend910B", 320.0, 1600.0, 64.0, 56.0, 2.20),
    ]
}


@dataclass(frozen=True)
class NodePool:
    """Identical machines: ``nodes`` machines with ``per_node`` devices of one type each, in the Slurm
    partition ``partition`` (the launcher places the planner's groups there; default: the pool's name)."""

    name: str
    device: Accelerator
    nodes: int
    per_node: int
    partition: str = ""

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class Cluster:
    """Node pools plus the bandwidth between machines (GB/s) for every pair of pools."""

    name: str
    pools: tuple[NodePool, ...]
    inter_node_gbs: dict

    @property
    def devices(self) -> int:
        return sum(p.devices for p in self.pools)

    def bandwidth(self, a: str, b: str) -> float:
        """Bandwidth between a machine of pool ``a`` and one of pool ``b`` (GB/s)."""
        return self.inter_node_gbs[frozenset((a, b))]

    def summary(self) -> str:
        return " + ".join(f"{p.devices} {p.device.name}" for p in self.pools)


def accelerator(name: str, prices: dict | None = None) -> Accelerator:
    """The catalogue entry for ``name`` (a price override from the cluster file applied)."""
    if name not in CATALOGUE:
        raise UserError(f"unknown device type '{name}'{closest(name, CATALOGUE)} (known: {', '.join(CATALOGUE)})")
    found = CATALOGUE[name]
    price = (prices or {}).get(name)
    return found if price is None else replace(found, price_per_hour=float(price))


def make_cluster(
    name: str, pools: list[tuple[str, str, int, int]], inter_node_gbs: dict, prices: dict | None = None
) -> Cluster:
    """Build a cluster from (pool name, device type, nodes, devices per node) rows and a bandwidth table.

    ``inter_node_gbs`` maps "a-b" (pool names, either order) to GB/s; a pair left out gets the slowest
    bandwidth given, so a cluster file needs only the links it knows.
    """
    try:
        pools = [(pool, kind, int(nodes), int(per_node)) for pool, kind, nodes, per_node in pools]
    except (TypeError, ValueError):
        raise UserError(f"cluster '{name}': nodes and per_node must be whole numbers, got {pools}") from None
    built = tuple(
        NodePool(pool, accelerator(kind, prices), nodes, per_node) for pool, kind, nodes, per_node in pools if nodes > 0
    )
    if not built:
        raise UserError(f"cluster '{name}' has no devices (every pool has 0 nodes); list at least one node pool")
    for pool in built:
        if pool.per_node < 1:
            raise UserError(f"pool '{pool.name}' has {pool.per_node} devices per node; it needs at least 1")
    links = {}
    for pair, gbs in (inter_node_gbs or {}).items():
        a, _, b = str(pair).partition("-")
        for end in (a, b):
            if end not in {p.name for p in built}:
                raise UserError(
                    f"link '{pair}' names pool '{end}'{closest(end, [p.name for p in built])} "
                    f"which the cluster does not have"
                )
        links[frozenset((a, b))] = float(gbs)
    if not links and (len(built) > 1 or built[0].nodes > 1):
        raise UserError(
            f"cluster '{name}' spans several machines but gives no inter_node_gbs "
            f"(e.g. inter_node_gbs: {{{built[0].name}-{built[0].name}: 5}})"
        )
    slowest = min(links.values(), default=0.0)
    for pool in built:  # a pool of one machine: its training and rollout devices meet inside it
        if pool.nodes == 1:
            links[frozenset((pool.name,))] = pool.device.link_gbs
    for a in built:
        for b in built:
            links.setdefault(frozenset((a.name, b.name)), slowest)
    return Cluster(name, built, links)


def read_yaml(path: str | Traversable, what: str, hint: str):
    """A YAML file's content; a missing or unparsable file is a one-line user error."""
    path = Path(path) if isinstance(path, str) else path
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist ({hint})")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"{what} {path} is not valid YAML: {str(exc).splitlines()[0]}") from None


def cluster_file(cluster: str | Path) -> Traversable:
    """What ``--cluster`` names: a YAML file, or a cluster of the shipped catalog by its name."""
    path = Path(cluster)
    if path.is_file() or path.suffix or len(path.parts) > 1:  # a path; read_yaml reports a missing one
        return path
    known = cluster_names()
    if path.name not in known:
        raise UserError(
            f"unknown cluster '{cluster}'{closest(path.name, known)} "
            f"(known: {', '.join(known)}; or give a cluster YAML file)"
        )
    return CLUSTERS / f"{path.name}.yaml"


def load_cluster(cluster: str | Path) -> Cluster:
    """Read a cluster YAML by path or catalog name (see the catalog's paper-8h800-24h20.yaml for the format)."""
    path = cluster_file(cluster)
    spec = read_yaml(path, "cluster file", f"give a cluster YAML or one of {', '.join(cluster_names())}") or {}
    if not isinstance(spec, dict):
        raise UserError(f"cluster file {path} must be a mapping with 'pools' (see areal_hpc/sched/catalog/clusters/)")
    rows = []
    for i, pool in enumerate(spec.get("pools") or []):
        missing = {"device", "nodes"} - set(pool if isinstance(pool, dict) else ())
        if missing:
            raise UserError(
                f"{path}: pool {i} lacks {', '.join(sorted(missing))} "
                f"(each pool needs device, nodes and optionally name, per_node)"
            )
        rows.append(
            (str(pool.get("name", pool["device"])), str(pool["device"]), pool["nodes"], pool.get("per_node", 8))
        )
    cluster = make_cluster(spec.get("name", Path(path.name).stem), rows, spec.get("inter_node_gbs"), spec.get("prices"))
    partitions = {
        str(pool.get("name", pool["device"])): str(pool.get("partition", pool.get("name", pool["device"])))
        for pool in spec["pools"]
    }
    return replace(cluster, pools=tuple(replace(p, partition=partitions[p.name]) for p in cluster.pools))
