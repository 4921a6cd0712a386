"""A trained reward model (``areal-hpc rm``) as the RL reward: ``reward.model: <its folder>``.

Each reward worker loads the model once and scores a completion by the value its head gives after the
last token of prompt + completion: the number Bradley-Terry training made comparable across completions
of a prompt. Scored one completion per call in the reward pool (its timeout and failure budget apply);
a tiny model on CPU scores in milliseconds, a large one belongs on a rollout server.
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_hpc.errors import UserError


def check_reward_model(folder: str) -> None:
    """One line unless ``folder`` holds a model with a one-output value head (what ``areal-hpc rm`` saves)."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        raise UserError(f"config key 'reward.model': {folder!r} has no config.json (give the model folder "
                        "`areal-hpc rm` saved: <run>/model)")
    architectures = json.loads(config.read_text()).get("architectures") or []
    if not any(name.endswith("ForTokenClassification") for name in architectures):
        raise UserError(f"config key 'reward.model': {folder} is a {', '.join(architectures) or 'model'} without a "
                        "value head; train a reward model with `areal-hpc rm` and give its <run>/model")


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

    def __call__(self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                 **fields) -> float:
        import torch

        model = self.load()
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
        with torch.no_grad():
            return float(model(input_ids=ids).logits[0, -1, 0])
