"""Tool-integrated reasoning: the model may run Python in a sandbox before it answers
(``rollout.workflow=python_tool``, ``configs/agent_python_tool.yaml``).

Each model turn ends at the end-of-turn token (the rollout servers stop on token ids, not strings), so a
tool call is a whole assistant turn: a turn holding a ```python fenced block (also ```py, ```python3;
every such block of the turn, in order, is one program; a block cut off by ``max_new_tokens`` runs up
to where it stops) is code. The environment runs it in the sandbox (``reward.sandbox.run_python``: CPU,
memory, file size and process limits, a wall clock, nothing outlives the call) in a worker thread, never
on the event loop, and replies with a ``tool`` message: the program's stdout and stderr, cut to
``max_output_chars`` (stdout's head, stderr's tail, where a traceback ends), and ``killed: <limit>``
(``cpu``, ``memory``, ``file_size``, ``wall_clock``, ``processes``) when a limit stopped it. A hostile
program is an observation, never an exception: the episode goes on. Each program runs in a fresh
process: nothing carries over from one call to the next.

A turn without a code block is the final answer, scored by the run's reward function
(``engine.reward``). At most ``max_turns`` model turns: an episode still writing code then scores the
empty answer (its last program is not run; nobody would read the result). With ``max_context_tokens``
(the servers' context length) the episode also stops that way before a turn that could not fit.

The tool's replies are context (``input_ids``), never trained on. The record's metadata counts
``tool_calls`` (programs run), ``tool_kills`` (of them, stopped at a limit) and ``tool_killed_by`` (the
limits, in order).
"""

from __future__ import annotations

import asyncio
import math
import re

from areal_hpc.data.tasks import Example
from areal_hpc.reward.sandbox import SandboxResult, run_python

TOOL_ROLE = "tool"
_OPEN = re.compile(r"```(?:python3?|py)[ \t]*\n", re.IGNORECASE)
_CLOSE = "```"
_CUT = "[...]"


def code_blocks(text: str) -> str | None:
    """The program of a turn: its ```python blocks joined in order (an unclosed last block runs to the
    end of the turn), or None when the turn has none (it is an answer)."""
    blocks, pos = [], 0
    while (start := _OPEN.search(text, pos)) is not None:
        end = text.find(_CLOSE, start.end())
        blocks.append(text[start.end() :] if end < 0 else text[start.end() : end])
        if end < 0:
            break
        pos = end + len(_CLOSE)
    return "\n".join(blocks) if blocks else None


def _head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - len(_CUT), 0)] + _CUT[:limit]


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else _CUT[:limit] + text[len(text) - max(limit - len(_CUT), 0) :]


def observation(result: SandboxResult, max_chars: int) -> str:
    """The environment's reply to a program: its output within ``max_chars`` (stdout's head, then
    stderr's tail, stderr keeping at least half when both are long), then ``killed: <limit>`` if a
    limit stopped it. A killed program's stderr (the refusal's traceback) is left out."""
    stdout, stderr = result.stdout, "" if result.killed_by else result.stderr
    stderr = _tail(stderr, max(max_chars - len(stdout), max_chars // 2))
    output = _head(stdout, max_chars - len(stderr)) + stderr
    if result.killed_by:
        return output + ("" if not output or output.endswith("\n") else "\n") + f"killed: {result.killed_by}"
    if output:
        return output
    return "(no output)" if result.returncode == 0 else f"(no output, exit status {result.returncode})"


class PythonToolWorkflow:
    def __init__(
        self,
        max_turns: int = 4,
        timeout_s: float = 2.0,
        memory_mb: int = 256,
        max_output_chars: int = 512,
        max_context_tokens: int | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns = {max_turns}; it must be >= 1")
        if timeout_s <= 0 or memory_mb < 1 or max_output_chars < 1:
            raise ValueError(
                f"timeout_s = {timeout_s}, memory_mb = {memory_mb}, max_output_chars = "
                f"{max_output_chars}: each must be positive"
            )
        self.max_turns, self.timeout_s, self.memory_mb = max_turns, float(timeout_s), int(memory_mb)
        self.max_output_chars, self.max_context_tokens = int(max_output_chars), max_context_tokens

    async def run_code(self, code: str) -> SandboxResult:
        """The program run in the sandbox, off the event loop (other episodes keep generating)."""
        return await asyncio.to_thread(
            run_python,
            code,
            timeout_s=self.timeout_s,
            cpu_s=max(1, math.ceil(self.timeout_s)),
            memory_mb=self.memory_mb,
        )

    def _fits(self, engine, episode) -> bool:
        return (
            self.max_context_tokens is None
            or len(episode.context) + engine.sampling.max_new_tokens <= self.max_context_tokens
        )

    async def arun_episode(self, engine, example: Example):
        episode = engine.episode(example)
        killed_by: list[str] = []
        calls = 0
        answer, answer_ids, answer_prompt = None, [], None
        for turn in range(self.max_turns):
            generation = await episode.generate()
            text = engine.decode(generation.output_ids)
            code = code_blocks(text)
            if code is None:
                answer, answer_ids, answer_prompt = text, list(generation.output_ids), list(generation.input_ids)
                break
            if turn + 1 == self.max_turns:
                break  # still writing code: no answer
            result = await self.run_code(code)
            calls += 1
            if result.killed_by:
                killed_by.append(result.killed_by)
            episode.observe_message(observation(result, self.max_output_chars), role=TOOL_ROLE)
            if not self._fits(engine, episode):
                break  # the next turn would not fit the context: no answer
        if answer is None:
            answer, answer_prompt = "", list(episode.context)
        episode.reward(await engine.reward(example, answer, answer_ids, prompt_ids=answer_prompt))
        record = episode.trajectory()
        record.metadata.update(tool_calls=calls, tool_kills=len(killed_by), tool_killed_by=killed_by)
        return [record]
