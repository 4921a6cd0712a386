"""Micro-batches without padding: AReaL's balanced allocation under a token budget (what every
engine step, RL and SFT, cuts its batch with), and 1D packing.

Packed sequences restart their position ids, which the Hugging Face attention masks turn into a
block-diagonal causal mask, so a packed forward equals one forward per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


def dynamic_microbatches(lengths: list[int], max_tokens: int, min_groups: int = 1) -> list[list[int]]:
    """AReaL's dynamic micro-batch allocation (Alg. 1): balanced groups of at most ``max_tokens`` tokens.

    Longest sequence first: open a new group while fewer than ``min_groups`` exist or when none has room,
    otherwise join the fitting group holding the fewest sequences (the earliest on ties). A sequence longer
    than the budget gets a group of its own.
    """
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fitting = [g for g, load in enumerate(loads) if load + lengths[i] <= max_tokens]
        if len(groups) < min_groups or not fitting:
            groups.append([i])
            loads.append(lengths[i])
        else:
            g = min(fitting, key=lambda g: len(groups[g]))
            groups[g].append(i)
            loads[g] += lengths[i]
    return groups


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, T] all sequences back to back
    position_ids: torch.Tensor  # [1, T] restarting at 0 for every sequence
    target_mask: torch.Tensor  # [T] True where token t+1 is a trained target (never across sequences)
    cu_seqlens: torch.Tensor  # [n + 1] sequence boundaries
    temperatures: torch.Tensor | None = None  # [T] the temperature of position t's logprob; None: the engine's

    @property
    def n_targets(self) -> int:
        return int(self.target_mask.sum())

    def to(self, device) -> PackedBatch:
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, torch.Tensor)})

    def target_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions whose next token is trained, those next tokens)."""
        targets = self.target_mask.nonzero()[:, 0]
        return targets, self.input_ids[0, targets + 1]

    def target_temperatures(self, targets: torch.Tensor, default: float) -> torch.Tensor:
        """[N, 1]: the temperature to divide the logits of positions ``targets`` by (``default`` for a
        batch without per-position temperatures)."""
        if self.temperatures is None:
            return torch.full((len(targets), 1), float(default), device=targets.device)
        return self.temperatures[targets, None].float()


def with_filler(packed: PackedBatch, multiple: int) -> PackedBatch:
    """``packed`` and, where its length is not a multiple of ``multiple``, one more sequence of token 0
    (no targets) making it one; the sequences before keep their positions."""
    extra = -packed.input_ids.shape[1] % multiple
    if not extra:
        return packed
    zeros = packed.input_ids.new_zeros(1, extra)
    temperatures = packed.temperatures
    return PackedBatch(
        torch.cat([packed.input_ids, zeros], 1),
        torch.cat([packed.position_ids, torch.arange(extra, device=zeros.device)[None]], 1),
        torch.cat([packed.target_mask, packed.target_mask.new_zeros(extra)]),
        torch.cat([packed.cu_seqlens, packed.cu_seqlens[-1:] + extra]),
        None if temperatures is None else torch.cat([temperatures, temperatures.new_ones(extra)]),
    )


def pack(
    sequences: list[list[int]], loss_masks: list[list[int]], temperatures: torch.Tensor | None = None
) -> PackedBatch:
    """Pack token sequences into one row; ``loss_masks[i][t]`` marks token t of sequence i as a target;
    ``temperatures``: [T] per-position logprob temperatures in the packed layout, or None."""
    lengths = torch.tensor([len(s) for s in sequences])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids = torch.tensor([tok for s in sequences for tok in s], dtype=torch.long)
    positions = torch.arange(int(cu_seqlens[-1])) - cu_seqlens[:-1].repeat_interleave(lengths)  # restarting at 0
    mask = torch.tensor([bool(m) for ms in loss_masks for m in ms])
    # Position t predicts token t+1: shift the mask left; the last token of a sequence predicts nothing.
    target_mask = torch.zeros_like(mask)
    target_mask[:-1] = mask[1:]
    target_mask[cu_seqlens[1:] - 1] = False
    return PackedBatch(ids[None], positions[None], target_mask, cu_seqlens, temperatures)
