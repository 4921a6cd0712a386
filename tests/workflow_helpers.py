"""Workflows as the controller runs them: ``episode_groups(...)`` wraps a workflow (the default RLVR one
unless given) in the group runner over a test's rollout client, tokenizer and reward pool; and
``ScriptedModel``, a stand-in ``generate`` that says given turns, for testing an environment alone."""

from areal_hpc.agents.engine import EpisodeSettings, Sampling, Scorer
from areal_hpc.agents.groups import EpisodeGroups
from areal_hpc.agents.rlvr import RLVRWorkflow
from areal_hpc.models.chat import completion_ids
from areal_hpc.rollout.client import Generation


def episode_groups(
    tokenizer,
    pool,
    sampling: Sampling,
    n_samples: int,
    workflow=None,
    task_name: str = "arithmetic",
    discount: float = 1.0,
) -> EpisodeGroups:
    return EpisodeGroups(
        workflow or RLVRWorkflow(),
        lambda client: EpisodeSettings(client.generate, tokenizer, sampling, Scorer(pool), None, discount),
        n_samples,
        task_name,
    )


class ScriptedModel:
    """A model that says the given turns, in order; records what it was asked to continue (``seen``)."""

    def __init__(self, tokenizer, turns: list[str]):
        self.outputs = [completion_ids(tokenizer, turn) for turn in turns]
        self.seen: list[list[int]] = []

    async def __call__(self, input_ids, params):
        self.seen.append(list(input_ids))
        output = self.outputs[len(self.seen) - 1]
        return Generation(list(input_ids), output, [-0.1] * len(output), [0] * len(output), "stop")
