"""Workflows as the controller runs them: ``episode_groups(...)`` wraps a workflow (the default RLVR one
unless given) in the group runner over a test's rollout client, tokenizer and reward pool;
``ScriptedModel``, a stand-in ``generate`` that says given turns, for testing an environment alone; and
``memorise``, which teaches a real model to say given turns (a stand-in for a tool-calling model)."""

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


def memorise(
    model, tokenizer, pairs: list[tuple[list[int], str]], max_steps: int = 600, confidence: float = 0.0
) -> None:
    """Teach the model to say each completion after its prompt, greedily, each token with at least
    ``confidence`` probability; one thread: the steps are small."""
    import torch

    batch = [
        (prompt, tokenizer(text + tokenizer.eos_token, add_special_tokens=False)["input_ids"]) for prompt, text in pairs
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _step in range(max_steps):
            optimizer.zero_grad()
            said = []
            for prompt, completion in batch:
                target = torch.tensor(completion)
                # the logits of the completion's positions only (the prompt's would cost a vocabulary each)
                logits = model(input_ids=torch.tensor([prompt + completion]), logits_to_keep=len(completion) + 1)
                logits = logits.logits[0, :-1]
                torch.nn.functional.cross_entropy(logits, target).backward()
                chance = logits.detach().softmax(-1).gather(1, target[:, None]).min().item()
                said.append(logits.argmax(-1).tolist() == completion and chance >= confidence)
            if all(said):
                return
            optimizer.step()
        raise AssertionError(f"the model did not learn to say {[text for _, text in pairs]} in {max_steps} steps")
    finally:
        torch.set_num_threads(threads)
        model.eval()
