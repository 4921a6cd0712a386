"""The task interface: examples (a prompt, the reference answer and any other columns), a train/eval
split, and the reward that scores a completion of one.

Every reward has one signature, AReaL's, whether built in or a user's ``reward.fn``::

    reward(prompt, completion, prompt_ids, completion_ids, **fields) -> float | {"reward": float, metric: float}

``fields`` are the example's ``answer`` and its other columns. ``data.registry.build_task`` builds a
task by name (the built-in generators) or from the user's files and reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    uid: str
    prompt: str  # the user turn, before the chat template ("" when the prompt is ``messages``)
    target: str = ""  # one correct completion, the SFT label ("" when the data has none)
    answer: str = ""  # what the reward checks
    fields: dict = field(default_factory=dict)  # every other column, passed to the reward and the workflow
    messages: tuple = ()  # a chat prompt: OpenAI chat messages ([{"role", "content"}, ...]), for the chat template
    tools: tuple = ()  # the OpenAI function tools offered with the prompt, as a client passes ``tools=``

    def chat_messages(self) -> list[dict]:
        """The prompt as chat messages (a new list): ``messages``, else one user turn holding ``prompt``."""
        return [dict(m) for m in self.messages] or [{"role": "user", "content": self.prompt}]

    def opening_messages(self) -> list[dict]:
        """Where an episode of this example starts: one user turn holding ``prompt``, else ``messages`` through
        the first user message (a multi-turn demonstration's later turns are what SFT trains, not an episode's
        start)."""
        if self.prompt or not self.messages:
            return [{"role": "user", "content": self.prompt}]
        first_user = next((i for i, m in enumerate(self.messages) if m["role"] == "user"), len(self.messages) - 1)
        return [dict(m) for m in self.messages[: first_user + 1]]

    def reward_fields(self) -> dict:
        """The keyword arguments a reward receives with the completion: ``answer`` and the other columns."""
        return {**self.fields, "answer": self.answer}


@dataclass
class Task:
    name: str
    train: list[Example]
    eval: list[Example]
    reward: object  # a ``data.rewards.RewardFunction`` (picklable into reward workers)
