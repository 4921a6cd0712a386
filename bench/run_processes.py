"""The processes of a run as the benchmarks see them from /proc: a process tree, each process's PSS,
and its role (launcher, fork server, rollout server, trainer, helpers), for forks of the fork server
too, whose command line is the fork server's but whose name (comm) the launcher sets."""

from __future__ import annotations

from pathlib import Path


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants that are alive now."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, queue = [], [root]
    while queue:
        pid = queue.pop()
        tree.append(pid)
        queue += children.get(pid, [])
    return tree


def pss_mib(pid: int) -> float:
    """Proportional set size of one process (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def role(pid: int) -> str:
    """What a process of a run is: from its name for a fork of the fork server, else its command line
    ("helpers": reward workers and multiprocessing's resource tracker); "gone" once it has exited."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    for prefix, label in (("rollout server", "rollout server"), ("trainer rank", "trainer")):
        if name.startswith(prefix):
            return label
    for needle, label in (
        (" serve ", "rollout server"),
        ("train.driver", "trainer"),
        ("forkserver", "fork server"),
        ("multiprocessing", "helpers"),
        (" train ", "launcher"),
    ):
        if needle in command:
            return label
    return "other"
