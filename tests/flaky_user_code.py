"""A user's reward and workflow that fail only sometimes, in files outside the package as a user writes them:
the reward raises on every 4th call (from the 1st) and returns NaN on every 4th (from the 2nd); the workflow
raises on every ``every``-th episode. ``write_flaky_code(folder)`` writes them; ``line_of`` finds a line."""

from pathlib import Path

REWARD = """calls = 0


def flaky(prompt, completion, prompt_ids, completion_ids, **fields):
    global calls
    calls += 1
    if calls % 4 == 1:
        raise ValueError(f"cannot score call {calls}")
    return float("nan") if calls % 4 == 2 else 1.0
"""

WORKFLOW = """from areal_hpc.agents.rlvr import RLVRWorkflow


class SometimesGivesUp(RLVRWorkflow):
    def __init__(self, every=5):
        self.every, self.calls = every, 0

    async def arun_episode(self, engine, example):
        self.calls += 1
        if self.calls % self.every == 0:
            raise RuntimeError(f"my workflow gave up on {example.uid}")
        return await super().arun_episode(engine, example)
"""


def write_flaky_code(folder: Path) -> tuple[Path, Path]:
    """(reward file, workflow file), resolved: their specs are ``<file>:flaky`` and ``<file>:SometimesGivesUp``."""
    reward, workflow = (folder / "my_reward.py").resolve(), (folder / "my_workflow.py").resolve()
    reward.write_text(REWARD)
    workflow.write_text(WORKFLOW)
    return reward, workflow


def line_of(path: Path, text: str) -> int:
    """The number of the first line of ``path`` that holds ``text``."""
    return 1 + next(i for i, line in enumerate(path.read_text().splitlines()) if text in line)
