"""The temperature rule, in one place for the samplers, the proxy and the trainer.

A sampling temperature T > 0 draws tokens from softmax(logits / T) and reports their logprobs under
it; T = 0 is greedy decoding (the argmax), whose logprobs are reported at T = 1, as SGLang does.
Temperatures in (0, MIN_TEMPERATURE) are never sampled: logits / T overflows float32 as T nears 0,
so rollout servers refuse them, and the proxy, where each client picks its own, reads them as greedy.
The trainer computes each token's logprob at ``logprob_temperature`` of the temperature it was
sampled at, so decoupled PPO's behaviour ratio compares like with like.
"""

from __future__ import annotations

from areal_hpc.config import GenerationConfig

MIN_TEMPERATURE = 1e-6


def is_greedy(temperature: float) -> bool:
    """Whether tokens sampled at ``temperature`` are the argmax."""
    return temperature == 0


def is_servable(temperature: float) -> bool:
    """Whether a rollout server samples at ``temperature``: 0 (greedy) or at least MIN_TEMPERATURE."""
    return is_greedy(temperature) or temperature >= MIN_TEMPERATURE


def requested_temperature(temperature: float) -> float:
    """The temperature a client's request for ``temperature`` (>= 0) is sampled at: itself, or 0
    (greedy) for one too near zero to sample at."""
    return temperature if is_servable(temperature) else 0.0


def run_temperature(generation: GenerationConfig) -> float:
    """The sampling temperature of a run's own rollouts: ``generation.temperature``, 0 when greedy."""
    return 0.0 if generation.greedy else generation.temperature


def logprob_temperature(temperature: float) -> float:
    """The temperature of the logprobs of tokens sampled at ``temperature``: itself, or 1 for greedy."""
    return 1.0 if is_greedy(temperature) else temperature
