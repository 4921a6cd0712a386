"""The training batch of RL: whole sequences plus per-position tensors, cut into micro-batches,
minibatches and data-parallel parts without ever padding.

Per-position tensors follow the packed layout of ``algo.packing.pack``: entry t of a sequence is
about predicting token t+1 (its behaviour logprob, its advantage, its loss weight), so they line up
with ``packed_policy_outputs`` when the sequences are packed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from areal_hpc.algo.packing import PackedBatch, pack


@dataclass
class SequenceBatch:
    sequences: list[list[int]]
    loss_masks: list[list[int]]  # per token: 1 where the token is trained (a model output)
    fields: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # name -> one [len] tensor per sequence
    # per sequence, [len]: the temperature of each position's logprob (None: the engine's own)
    temperatures: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def n_tokens(self) -> int:
        return sum(map(len, self.sequences))

    def select(self, indices: list[int]) -> SequenceBatch:
        return SequenceBatch(
            [self.sequences[i] for i in indices],
            [self.loss_masks[i] for i in indices],
            {name: [values[i] for i in indices] for name, values in self.fields.items()},
            None if self.temperatures is None else [self.temperatures[i] for i in indices],
        )

    def packed(self) -> tuple[PackedBatch, dict[str, torch.Tensor]]:
        """One row of all sequences and each field concatenated in the same order."""
        temperatures = None if self.temperatures is None else torch.cat(self.temperatures)
        return (
            pack(self.sequences, self.loss_masks, temperatures),
            {name: torch.cat(values) for name, values in self.fields.items()},
        )

    def set_packed(self, name: str, values: torch.Tensor) -> None:
        """Store a packed [T] tensor (e.g. recomputed logprobs) as a per-sequence field."""
        self.fields[name] = list(values.split([len(s) for s in self.sequences]))


def balanced_parts(lengths: list[int], parts: int, weights: list[float] | None = None) -> list[list[int]]:
    """Split sequence indices into ``parts`` groups whose token counts follow ``weights`` (default: equal):
    longest first, each to the group least loaded for its weight, so data-parallel ranks of different
    speeds finish a step together."""
    weights = weights or [1.0] * parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        lightest = min(range(parts), key=lambda g: (loads[g] + lengths[i]) / weights[g])
        groups[lightest].append(i)
        loads[lightest] += lengths[i]
    return groups
