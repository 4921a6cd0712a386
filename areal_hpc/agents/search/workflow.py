"""The search agent (ASearcher's loop): each model turn is one tool call, the environment's reply is the
next message, for up to ``max_turns`` turns.

- ``<search>words</search>``: the ``top_k`` best pages of the local corpus (BM25), as
  ``[page id] title: snippet`` lines (the snippet alone where the title is the id, which starts it);
- ``<open>page id</open>``: the page's text (at most ``page_chars``);
- ``<answer>text</answer>``: ends the episode.

The first complete tag of a turn is its call (the rest of the turn is ignored). A turn without one, an
empty query or an unknown page id gets a short error message and the episode goes on: what the model
writes never raises. The environment's messages are context, masked out of the loss; whatever the
model wrote is echoed back only cut short and without ``<``, ``>`` and ``|`` (no special token or tag
can be injected into the context).

The episode's reward is the run's reward of the answering turn's text (``""`` when the model never
answered), on its last turn: with ``reward.fn: areal_hpc.agents.search.reward:exact_match_f1`` that is
exact match, with the token F1 beside it as a metric. ``max_context_tokens`` (0: no limit) ends an
episode before a turn that could overflow the rollout servers' context (prompt, turns and replies
together, plus ``generation.max_new_tokens``): set it to the context length for long episodes.
"""

from __future__ import annotations

import re

from areal_hpc.agents.search.index import MAX_QUERY_CHARS, PAGE_CHARS, SNIPPET_CHARS, get_index, normalise_id
from areal_hpc.agents.search.reward import first_tag
from areal_hpc.data.tasks import Example
from areal_hpc.errors import UserError
from areal_hpc.models.chat import next_turn_ids

TOOLS = ("search", "open", "answer")
NO_TOOL_CALL = "no tool call found; use <search>...</search>, <open>...</open> or <answer>...</answer>"
ECHO_CHARS = 64
_UNSAFE = re.compile(r"[<>|\s]+")


def parse_action(text: str) -> tuple[str, str] | None:
    """(tool, argument) of the turn's first complete tool call (argument stripped), or None."""
    found = first_tag(text, TOOLS) if isinstance(text, str) else None
    return None if found is None else (found[0], found[1].strip())


def echo(text: str) -> str:
    """What the model wrote, safe to repeat in the environment's message: short, one line, no tags."""
    text = _UNSAFE.sub(" ", text).strip()
    return text if len(text) <= ECHO_CHARS else text[: ECHO_CHARS - 3] + "..."


class SearchAgentWorkflow:
    def __init__(
        self,
        max_turns: int = 16,
        top_k: int = 3,
        corpus_seed: int = 0,
        snippet_chars: int = SNIPPET_CHARS,
        page_chars: int = PAGE_CHARS,
        max_context_tokens: int = 0,
        observation_role: str = "user",
        named: bool = True,
    ):
        for name, value, least in (
            ("max_turns", max_turns, 1),
            ("top_k", top_k, 1),
            ("snippet_chars", snippet_chars, 16),
            ("page_chars", page_chars, 16),
            ("max_context_tokens", max_context_tokens, 0),
        ):
            if not isinstance(value, int) or value < least:
                raise UserError(f"search workflow: {name} = {value!r}; it must be an integer >= {least}")
        self.max_turns, self.top_k, self.corpus_seed = max_turns, top_k, corpus_seed
        self.snippet_chars, self.page_chars = snippet_chars, page_chars
        self.max_context_tokens, self.observation_role = max_context_tokens, observation_role
        if not isinstance(named, bool):
            raise UserError(f"search workflow: named = {named!r}; it must be true (made-up names) or false (page ids)")
        self.named = named

    def respond(self, action: tuple[str, str] | None) -> str:
        """The environment's message for a turn's tool call (not an answer)."""
        if action is None:
            return NO_TOOL_CALL
        tool, argument = action
        index = get_index(self.corpus_seed, self.named)
        if tool == "search":
            if not argument:
                return "empty query; write words to search for: <search>...</search>"
            results = index.search(argument[:MAX_QUERY_CHARS], self.top_k, self.snippet_chars)
            if not results:
                return f"no results for: {echo(argument)}"
            lines = [
                snippet if title == page_id else f"[{page_id}] {title}: {snippet}"
                for page_id, title, snippet in results
            ]
            return "<information>\n" + "\n".join(lines) + "\n</information>"
        try:
            text = index.open_page(argument, self.page_chars)
        except KeyError:
            return f"no page with id: {echo(argument)}; open an id the search results show"
        return f"<information>\n[{normalise_id(argument)}] {text}\n</information>"

    async def arun_episode(self, engine, example: Example):
        episode = engine.episode(prompt_ids=engine.opening_ids(example))
        counts = dict.fromkeys(TOOLS, 0) | {"invalid": 0}
        answered, ended_by_context = None, False
        while True:
            generation = await episode.generate()
            action = parse_action(engine.decode(generation.output_ids))
            counts[action[0] if action else "invalid"] += 1
            if action is not None and action[0] == "answer":
                answered = generation
                break
            if episode.turns >= self.max_turns:
                break
            reply = next_turn_ids(engine.tokenizer, self.observation_role, self.respond(action), generation.output_ids)
            if self.max_context_tokens and (
                len(episode.context) + len(reply) + engine.sampling.max_new_tokens > self.max_context_tokens
            ):
                ended_by_context = True
                break
            episode.observe(reply)
        completion = engine.decode(answered.output_ids) if answered is not None else ""
        last = episode.generations[-1]
        prompt_ids = episode.context[: len(episode.context) - len(last.output_ids)]
        episode.reward(
            await engine.reward(
                example, completion, list(answered.output_ids) if answered else [], prompt_ids=prompt_ids
            )
        )
        record = episode.trajectory()
        record.metadata.update(
            {
                "search_calls": counts["search"],
                "open_calls": counts["open"],
                "invalid_calls": counts["invalid"],
                "answered": answered is not None,
                "ended_by_context": ended_by_context,
            }
        )
        return [record]
