"""Fit the cost model's efficiency factors to measured runs (least squares on log ratios).

A ``Measurement`` predicts one number from an ``Efficiency`` (a plan's tokens/s, a weight-sync
time) and holds what was measured; ``fit_efficiency`` moves the named factors until predictions
and measurements agree best. Plans are integer choices, so the fit is derivative-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize

from areal_hpc.sched.cost import Efficiency


@dataclass(frozen=True)
class Measurement:
    label: str
    measured: float
    predict: Callable[[Efficiency], float]


def log_errors(efficiency: Efficiency, measurements: list[Measurement]) -> np.ndarray:
    return np.array([np.log(m.predict(efficiency) / m.measured) for m in measurements])


def fit_efficiency(measurements: list[Measurement], names: list[str], start: Efficiency = Efficiency()) -> Efficiency:
    """The ``start`` factors with ``names`` refitted to ``measurements``: fractions of a roofline stay
    within (0, 1]; a device type's factor (``H20.train``, relative to the others) is only kept positive."""

    def build(x) -> Efficiency:
        return start.replace(**{n: float(np.exp(v) if "." in n else min(1.0, np.exp(v))) for n, v in zip(names, x)})

    def loss(x) -> float:
        return float(np.sum(log_errors(build(x), measurements) ** 2))

    x0 = np.log([start.factor(n) for n in names])
    # First steps go down by a factor 0.6: a start at the cap of 1 would otherwise see a flat loss.
    simplex = np.vstack([x0, x0 - 0.5 * np.eye(len(names))])
    result = minimize(
        loss,
        x0,
        method="Nelder-Mead",
        options={"xatol": 1e-3, "fatol": 1e-6, "maxiter": 400, "initial_simplex": simplex},
    )
    return build(result.x)
