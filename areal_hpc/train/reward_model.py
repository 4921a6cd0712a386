"""A trained reward model (``areal-hpc rm``) as the RL reward: ``reward.model: <its folder>``.

Each reward worker loads the model once and scores a completion by the value its head gives after the
last token of prompt + completion: the number Bradley-Terry training made comparable across completions
of a prompt. The reward pool hands each worker its share of a call (a group's samples, or several
groups') and the model scores them in padded forwards of at most ``TOKENS_PER_FORWARD`` tokens (the
pool's timeout and failure budget apply); a large model belongs on a rollout server.
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_hpc.errors import UserError

TOKENS_PER_FORWARD = 16384  # padded tokens scored in one forward (rows x longest row)


def check_reward_model(folder: str) -> None:
    """One line unless ``folder`` holds a model with a one-output value head (what ``areal-hpc rm`` saves)."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        raise UserError(
            f"config key 'reward.model': {folder!r} has no config.json (give the model folder "
            "`areal-hpc rm` saved: <run>/model)"
        )
    architectures = json.loads(config.read_text()).get("architectures") or []
    if not any(name.endswith("ForTokenClassification") for name in architectures):
        raise UserError(
            f"config key 'reward.model': {folder} is a {', '.join(architectures) or 'model'} without a "
            "value head; train a reward model with `areal-hpc rm` and give its <run>/model"
        )


class RewardModelScore:
    """reward(prompt, completion, prompt_ids, completion_ids, **fields) -> the model's score. Picklable: the
    model is loaded in the process that first calls it."""

    def __init__(self, folder: str):
        self.folder, self._model = str(folder), None

    def __getstate__(self):
        return {"folder": self.folder}

    def __setstate__(self, state):
        self.__init__(state["folder"])

    def load(self):
        """The model, loaded once (the reward pool calls this when a worker starts)."""
        if self._model is None:
            import torch

            from areal_hpc.models.hf import load_critic

            torch.set_num_threads(1)  # a reward worker: one core, beside the rollouts
            self._model = load_critic(self.folder).eval()
        return self._model

    def __call__(
        self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **fields
    ) -> float:
        return self.scores([list(prompt_ids) + list(completion_ids)])[0]

    def score_batch(self, requests) -> list[float]:
        """The reward pool's batch call: one score per ``RewardRequest``."""
        return self.scores([list(r.prompt_ids) + list(r.completion_ids) for r in requests])

    def scores(self, sequences: list[list[int]]) -> list[float]:
        """The value after each sequence's last token. Rows go longest first into forwards of at most
        ``TOKENS_PER_FORWARD`` padded tokens, padded on the right: causal attention keeps each last
        token's value that of the sequence alone."""
        import torch

        model = self.load()
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        scores = [0.0] * len(sequences)
        start = 0
        while start < len(order):
            width = len(sequences[order[start]])
            rows = order[start : start + max(1, TOKENS_PER_FORWARD // max(width, 1))]
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for row, i in enumerate(rows):
                ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                mask[row, : len(sequences[i])] = 1
            with torch.no_grad():
                values = model(input_ids=ids, attention_mask=mask).logits[..., 0]
            last = mask.sum(1) - 1
            for row, i in enumerate(rows):
                scores[i] = float(values[row, last[row]])
            start += len(rows)
        return scores
