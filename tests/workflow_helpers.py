"""Workflows as the controller runs them: ``episode_groups(...)`` wraps a workflow (the default RLVR one
unless given) in the group runner over a test's rollout client, tokenizer and reward pool."""

from areal_hpc.agents.engine import EngineSettings, Sampling, Scorer
from areal_hpc.agents.groups import EpisodeGroups
from areal_hpc.agents.rlvr import RLVRWorkflow


def episode_groups(tokenizer, pool, sampling: Sampling, n_samples: int, workflow=None, task_name: str = "arithmetic",
                   discount: float = 1.0) -> EpisodeGroups:
    return EpisodeGroups(workflow or RLVRWorkflow(),
                         lambda client: EngineSettings(client.generate, tokenizer, sampling, Scorer(pool), None, discount),
                         n_samples, task_name)
