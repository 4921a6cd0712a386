"""The endless, resumable stream of training prompts the rollout controller draws from."""

from __future__ import annotations

import random

from areal_hpc.data.tasks import Example


class PromptStream:
    """Training prompts in seeded shuffled passes, endless; ``drawn`` says where to continue after a resume."""

    def __init__(self, examples: list[Example], seed: int, drawn: int = 0):
        self.examples, self.seed, self.drawn = examples, seed, 0
        self._order: list[int] = []
        for _ in range(drawn):
            next(self)

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> Example:
        position = self.drawn % len(self.examples)
        if position == 0:
            self._order = list(range(len(self.examples)))
            random.Random(self.seed * 1_000_003 + self.drawn // len(self.examples)).shuffle(self._order)
        self.drawn += 1
        return self.examples[self._order[position]]
