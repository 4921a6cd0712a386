"""Sessions of one agent: its turns, linked into conversations by prefix matching of token ids, their
rewards, and the trajectory records an ended session becomes.

A turn extends an earlier one when its prompt starts with that turn's prompt and output: the proxy
builds it so (``Session.extension``), sending the earlier turn's exact ids and tokenising only the
new text, so a record's segments concatenate to exactly the tokens the model saw and produced. A
chat request extends a turn when its rendered text starts with that turn's tokens decoded, or with
the template's own writing of the reply (tool calls as the template writes them, not as sampled).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.proxy.chat_template import ChatTokenizer
from areal_hpc.proxy.openai_api import reply_message

REWARD_SOURCE = "proxy"


@dataclass(eq=False)
class Turn:
    """One completion: what the model was given and what it produced, exactly."""

    interaction_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    temperature: float  # sampled at (0: greedy); the trainer recomputes the logprobs at it
    parent: Turn | None = None
    text: str = ""  # prompt and output decoded with special tokens: what a prompt extending this turn starts with
    reply: dict | None = None  # a chat turn's assistant message, as the client got it
    rendered: str = ""  # the template's writing of the conversation through ``reply``, closing included
    bridge: str = ""  # the closing text the model did not generate itself (after its end-of-turn token: "\n")
    cached_tokens: int = 0  # prompt tokens the rollout server's prefix cache held

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1

    def chain(self) -> list[Turn]:
        """The conversation up to this turn, first turn first."""
        turns, turn = [], self
        while turn is not None:
            turns.append(turn)
            turn = turn.parent
        return turns[::-1]


def new_id(prefix: str = "") -> str:
    return prefix + secrets.token_hex(16)


@dataclass(eq=False)
class Session:
    """One agent's session: owned by ``tenant``, addressed by a secret key whose hash is ``key_hash``."""

    tenant: str
    tenant_key_hash: str  # the tenant key that opened it: revoking that key closes the session's key too
    key_hash: str
    id: str = field(default_factory=new_id)
    metadata: dict = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    rewards: dict[str, float] = field(default_factory=dict)  # interaction id -> latest reward
    ended_at: float | None = None
    trajectory_ids: dict[str, str] = field(default_factory=dict)  # leaf interaction id -> record id, once written
    backend: str | None = None  # the server that holds this session's prefix cache

    def extension(self, text: str) -> tuple[Turn, str, int] | None:
        """(the turn ``text`` extends, the bridge, where in ``text`` the rest starts): the text after that
        turn's ids is the bridge then ``text[start:]``; longest match first (the newest on a tie); None
        when it extends none."""
        links = [
            (len(key), t, bridge)
            for t in reversed(self.turns)
            for key, bridge in ((t.text, ""), (t.rendered, t.bridge))
            if key and len(text) > len(key) and text.startswith(key)
        ]
        best = max(links, key=lambda link: link[0], default=None)
        return None if best is None else (best[1], best[2], best[0])

    def parent_by_ids(self, ids: list[int]) -> Turn | None:
        """The turn whose prompt and output ``ids`` extends, longest first (the newest on a tie)."""
        extended = (
            t for t in reversed(self.turns) if len(ids) > len(t.full_ids) and ids[: len(t.full_ids)] == t.full_ids
        )
        return max(extended, key=lambda t: len(t.full_ids), default=None)

    def turn(self, interaction_id: str | None) -> Turn | None:
        """The turn of ``interaction_id``; None for the last turn (or no turn yet)."""
        if interaction_id is None:
            return self.turns[-1] if self.turns else None
        return next((t for t in self.turns if t.interaction_id == interaction_id), None)

    def leaves(self) -> list[Turn]:
        """The last turn of each conversation: turns no other turn extends, oldest first."""
        parents = {id(t.parent) for t in self.turns if t.parent is not None}
        return [t for t in self.turns if id(t) not in parents]

    def trajectories(self, discount: float) -> list[Trajectory]:
        """One record per conversation (a session whose turns all extend each other is one record)."""
        records = []
        for n, leaf in enumerate(self.leaves()):
            chain = leaf.chain()
            segments, rewards = [], []
            for step, turn in enumerate(chain):
                known = len(turn.parent.full_ids) if turn.parent is not None else 0
                segments.append(
                    Segment(
                        turn.prompt_ids[known:],
                        turn.output_ids,
                        turn.logprobs,
                        turn.versions,
                        temperature=turn.temperature,
                    )
                )
                if turn.interaction_id in self.rewards:
                    rewards.append(Reward(self.rewards[turn.interaction_id], step=step, source=REWARD_SOURCE))
            metadata = {
                **self.metadata,
                "interaction_ids": [t.interaction_id for t in chain],
                "discount": discount,
                "finish_reasons": [t.finish_reason for t in chain],
            }
            records.append(
                Trajectory(
                    segments,
                    id=f"{self.id}-{n}",
                    session_id=self.id,
                    tenant=self.tenant,
                    rewards=rewards,
                    metadata=metadata,
                )
            )
        return records

    def chains_holding(self, turn: Turn) -> list[tuple[str, int]]:
        """(record id, step) of every written record whose conversation holds ``turn``."""
        return [
            (record, chain.index(turn))
            for leaf, record in self.trajectory_ids.items()
            for chain in [self.turn(leaf).chain()]
            if turn in chain
        ]


def keep_reply(
    turn: Turn,
    tokenizer: ChatTokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    template_args: dict | None = None,
) -> None:
    """A chat turn's reply message (in the template's family's format: tool calls parsed when tools were
    offered, reasoning apart), and how the template writes it once the agent sends it back (content as the
    proxy reads messages: None is "")."""
    turn.reply = reply_message(tokenizer.decode(turn.output_ids), bool(tools), tokenizer.family)
    turn.rendered, closing = tokenizer.reply_rendering(
        messages, tools, {**turn.reply, "content": turn.reply["content"] or ""}, template_args
    )
    eos = tokenizer.eos_token_ids[:1]
    eos_text = tokenizer.decode(eos, skip_special_tokens=False) if eos and turn.output_ids[-1:] == eos else ""
    turn.bridge = closing[len(eos_text) :] if closing.startswith(eos_text) else closing


def discounted_returns(rewards: dict[int, float], n_turns: int, discount: float) -> list[float]:
    """Each turn's return: its own reward plus later turns' rewards discounted by ``discount`` per turn
    (a reward given only for the last turn reaches turn ``j`` as ``discount ** (last - j)`` of it)."""
    returns, running = [0.0] * n_turns, 0.0
    for step in reversed(range(n_turns)):
        running = rewards.get(step, 0.0) + discount * running
        returns[step] = running
    return returns


def session_returns(session: Session, leaf: Turn, discount: float) -> list[float]:
    chain = leaf.chain()
    rewards = {
        step: session.rewards[t.interaction_id] for step, t in enumerate(chain) if t.interaction_id in session.rewards
    }
    return discounted_returns(rewards, len(chain), discount)
