"""Vectorised sampling for the embedded engine: temperature, top-k, top-p and greedy, every row at once.

Each KV row's sampling parameters live in tensors beside the cache (set when a request is admitted,
moved with its row), so a step samples all rows with a fixed number of tensor operations and no
Python per row. A draw picks token i with probability p_i / sum(p), as ``torch.multinomial`` does.
Those tensors bound what a request may ask for (``MAX_TEMPERATURE``, ``MAX_TOP_K``): the engine refuses
larger values before a request is admitted.

Draws are seeded per request, not per batch: the uniform number that picks a row's token is a hash of
the request's seed and the token's position in its sequence (SplitMix64, ``seeded_uniform``). A
request's tokens therefore depend on its seed, prompt and the model only, never on which other
requests share the batch or in which row it runs, and a request resumed after an interruption (its
earlier output now part of the prompt) continues the same stream. That is what makes synchronous RL
repeat itself exactly (SGLang's ``sampling_seed`` serves the same purpose).
"""

from __future__ import annotations

import torch

from areal_hpc.algo.temperature import is_greedy, logprob_temperature

MAX_TEMPERATURE = torch.finfo(torch.float32).max  # the per-row temperatures are float32
MAX_TOP_K = torch.iinfo(torch.long).max  # the per-row top-k are int64 (any k >= the vocabulary keeps it all)
MAX_SEED = torch.iinfo(torch.long).max  # the per-row seeds are int64


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN_GAMMA = _int64(0x9E3779B97F4A7C15)
MIX1, MIX2 = _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values: torch's >> is arithmetic."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 numbers in (0, 1], one per row: SplitMix64's output for state seed + (position + 1)·γ,
    its top 53 bits. int64 arithmetic wraps modulo 2**64 as the algorithm needs."""
    z = seeds + (positions + 1) * GOLDEN_GAMMA
    z = (z ^ _shift_right(z, 30)) * MIX1
    z = (z ^ _shift_right(z, 27)) * MIX2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 11) + 1).double() * 2.0**-53


class SlotSampler:
    """Per-row temperature, top-k, top-p and greedy flag; ``sample`` draws a token for rows first..first+n."""

    def __init__(self, slots: int, device: torch.device, seed: int = 0):
        self.temperature = torch.ones(slots, dtype=torch.float32, device=device)  # 1 for greedy rows: logprobs at T = 1
        self.top_k = torch.zeros(slots, dtype=torch.long, device=device)  # 0: no top-k
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.greedy = torch.zeros(slots, dtype=torch.bool, device=device)
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)
        self.position = torch.zeros(slots, dtype=torch.long, device=device)  # of the row's next token
        self.generator = torch.Generator(device=device).manual_seed(seed)  # seeds of requests that bring none

    def set(
        self, row: int, temperature: float, top_k: int, top_p: float, seed: int | None = None, position: int = 0
    ) -> None:
        """A new request's parameters in ``row``: temperature 0 is greedy, top_k <= 0 keeps every token;
        ``seed`` (None: one from this sampler's generator) and the position of its first new token.
        A temperature above MAX_TEMPERATURE or a top_k above MAX_TOP_K does not fit its tensor: it raises."""
        self.temperature[row], self.greedy[row] = logprob_temperature(temperature), is_greedy(temperature)
        self.top_k[row], self.top_p[row] = max(top_k, 0), top_p
        if seed is None:
            seed = int(torch.randint(0, MAX_SEED, (), generator=self.generator, device=self.generator.device))
        self.seed[row], self.position[row] = seed, position

    def move_rows(self, sources: list[int], targets: list[int]) -> None:
        """Rows ``sources``' parameters into rows ``targets``, every source read before a target is written."""
        if not sources:
            return
        source, target = (torch.tensor(rows, device=self.seed.device) for rows in (sources, targets))
        for values in (self.temperature, self.top_k, self.top_p, self.greedy, self.seed, self.position):
            values[target] = values[source]

    def sample(self, logits: torch.Tensor, first_row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens [n], their logprobs under ``log_softmax(logits / T)`` (the whole tempered distribution,
        before truncation) and whether each row's logits were finite (a row that is not gets token 0)."""
        rows = slice(first_row, first_row + len(logits))
        logprobs = torch.log_softmax(logits / self.temperature[rows, None], dim=-1)
        finite = torch.isfinite(logprobs.amax(dim=-1))  # NaN, +inf or all -inf: not a distribution
        tokens = logprobs.argmax(dim=-1)
        greedy = self.greedy[rows]
        if not bool(greedy.all()):
            probs = torch.where(finite[:, None], logprobs.exp(), 1.0)  # a NaN row must not pick a token
            top_k, top_p = self.top_k[rows], self.top_p[rows]
            if bool(((top_k > 0) | (top_p < 1)).any()):
                probs = truncate(probs, top_k, top_p)
            tokens = torch.where(greedy, tokens, draw(probs, seeded_uniform(self.seed[rows], self.position[rows])))
        self.position[rows] += 1
        tokens = tokens.masked_fill_(~finite, 0)
        return tokens, logprobs.gather(1, tokens[:, None])[:, 0], finite


def truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero what top-k and then top-p exclude, row by row (probs [n, V], not renormalised).

    Top-k keeps the tokens at least as probable as the k-th (``top_k`` <= 0: all). Top-p keeps the
    smallest prefix of the remaining tokens, most probable first, whose mass (of the whole
    distribution) reaches ``top_p``; rows with ``top_p`` >= 1 keep them all, rounding aside.
    """
    vocab = probs.shape[-1]
    if not bool((top_p < 1).any()):  # top-k alone needs the k-th largest, not a sort (20x cheaper)
        k = top_k.clamp(1, vocab)  # a row without top-k gets threshold 0 below
        kth = probs.topk(int(k.max()), dim=-1).values.gather(1, k[:, None] - 1)
        return probs.masked_fill(probs < torch.where(top_k[:, None] > 0, kth, 0), 0)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    ordered = ordered.masked_fill(ordered < ordered.gather(1, k[:, None] - 1), 0)
    threshold = torch.where(top_p < 1, top_p, torch.inf)[:, None]
    ordered.masked_fill_(ordered.cumsum(dim=-1) - ordered > threshold, 0)
    return torch.empty_like(probs).scatter_(1, order, ordered)


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row with probability proportional to ``probs`` [n, V] (unnormalised, >= 0, some > 0),
    picked by ``uniform`` [n] (float64 in (0, 1], one per row).

    Inverse CDF: the first token whose cumulative mass reaches u x total. One random number per row
    (an exponential race needs V), and a zero-probability token is never
    picked: its cumulative mass equals its predecessor's. Float64 keeps a small probability's share
    of the cumulative sum exact enough at any vocabulary size.
    """
    cumulative = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cumulative, uniform[:, None] * cumulative[:, -1:])[:, 0]
