"""PNG curves of a run's metrics (what people look at first), drawn headless with matplotlib."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SMOOTH_FROM = 30  # points in a curve from which a moving average is drawn over the raw values


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    sums = np.cumsum([0.0, *values])
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(window, i + 1) for i in range(len(values))]


def plot_curves(records: list[dict], panels: dict[str, str], out: Path, title: str) -> Path:
    """One panel per (label -> metric key), each metric against step; missing points are skipped. A long
    curve (per-step metrics) is drawn faint with its moving average over a twentieth of the run on top."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (label, key) in zip(axes[0], panels.items()):
        points = [(r["step"], r[key]) for r in records if key in r]
        if len(points) >= SMOOTH_FROM:
            steps, values = zip(*points)
            window = max(5, len(points) // 20)
            ax.plot(steps, values, alpha=0.3, color="tab:blue")
            ax.plot(steps, moving_average(list(values), window), color="tab:blue", label=f"mean of {window} steps")
            ax.legend(loc="lower right", fontsize=8)
        elif points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o")
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
