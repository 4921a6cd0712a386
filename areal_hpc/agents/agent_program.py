"""``rollout.workflow=agent_program``: rollouts from an agent program you wrote against the OpenAI API (the
``openai`` client, the OpenAI Agents SDK, any language), run as it is, in a process of its own, once an
episode. The run serves its episode chat (the proxy's turn routes, ``agents.chat``) over HTTP on loopback and
starts ``command`` with, in its environment:

- ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (the episode's session key): an OpenAI client built with no
  arguments talks to the run's model; ``OPENAI_MODEL``: the model name to ask for;
  ``OPENAI_AGENTS_DISABLE_TRACING=1`` (no traces leave the cluster); the run's Python first on ``PATH``;

and the example on stdin as JSON: ``{"id", "messages", "fields"}`` (the prompt as chat messages, the data's
other columns). Every turn it asks for is recorded token for token and sampled as the run samples (greedy in
an evaluation); what it prints on stdout is its final answer, scored by the run's reward, unless it rewarded
its turns itself (the proxy's ``POST /rl/set_reward``, beside ``/v1``).

A program that exits non-zero, runs past ``timeout_s``, prints what is not UTF-8 text or never asks the model
fails its episode as ``agent_program``: counted and charged to the failure budget, reported as one line with
its last words on stderr (and the file and line of a Python traceback in them).

    areal-hpc train --config configs/agent_program.yaml     # the Agents SDK example, configs/agent_program.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path

from areal_hpc.data.tasks import Example
from areal_hpc.errors import UserError, traceback_location
from areal_hpc.rollout.controller import EpisodeFailure
from areal_hpc.runtime.run_state import STOP_GRACE_S

KIND = "agent_program"
KEY = "rollout.workflow_args"
LAST_WORDS_CHARS = 300  # of a failed program's stderr, in its failure line


class AgentProgramWorkflow:
    def __init__(self, command: str | list[str] = "", timeout_s: float = 600.0):
        """``command``: the program and its arguments (a string split as a shell would, or a list), run in the
        run's working folder; ``timeout_s``: how long an episode's program may run before it is killed."""
        argv = shlex.split(command) if isinstance(command, str) else [str(part) for part in command]
        self.path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        if not argv:
            raise UserError(f"config key '{KEY}.command' is empty: the agent program to run, e.g. 'python agent.py'")
        if shutil.which(argv[0], path=self.path) is None:
            raise UserError(
                f"config key '{KEY}.command': {argv[0]!r} is neither a program on PATH nor an executable file "
                f"(the agent program to run, e.g. 'python agent.py')"
            )
        if not timeout_s > 0:
            raise UserError(f"config key '{KEY}.timeout_s': {timeout_s!r} is not a positive number of seconds")
        self.argv, self.timeout_s = argv, float(timeout_s)
        self.command = shlex.join(argv)

    async def arun_episode(self, engine, example: Example):
        client = engine.openai_client(example=example.uid)
        env = {
            **os.environ,
            "PATH": self.path,
            "OPENAI_BASE_URL": await engine.openai_base_url(),
            "OPENAI_API_KEY": client.api_key,
            "OPENAI_MODEL": engine.model_name,
            "OPENAI_AGENTS_DISABLE_TRACING": "1",
        }
        given = {"id": example.uid, "messages": example.chat_messages(), "fields": example.fields}
        try:
            answer = await self.run(json.dumps(given, default=str).encode(), env)
            if not client.session.turns:
                raise EpisodeFailure(
                    KIND, f"{self.command} ended without asking the model (at OPENAI_BASE_URL, with OPENAI_API_KEY)"
                )
        except BaseException:
            client.records()  # its session ends with the episode
            raise
        if not client.session.rewards:  # (rewards the program set are the episode's)
            client.set_reward(await engine.reward(example, answer))
        return None  # the session's conversations

    async def run(self, stdin: bytes, env: dict[str, str]) -> str:
        """What the program printed on stdout, stripped, once it exited 0; an ``EpisodeFailure`` otherwise."""
        process = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group: ended with whatever it started
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(stdin), self.timeout_s)
        except TimeoutError:
            raise EpisodeFailure(KIND, f"{self.command} ran past {self.timeout_s:g} s ({KEY}.timeout_s)") from None
        finally:
            if process.returncode is None:  # timed out, or the episode was cancelled (a stop, a failed sibling)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if process.returncode == -signal.SIGTERM:  # Slurm's, maybe: the run sees its own signal meanwhile, and
            await asyncio.sleep(STOP_GRACE_S)  # the controller does not count a failure after it
        if process.returncode:
            raise EpisodeFailure(KIND, f"{self.command} {exit_status(process.returncode)}{last_words(err)}")
        try:
            return out.decode().strip()
        except UnicodeDecodeError as exc:
            raise EpisodeFailure(KIND, f"{self.command} printed what is not UTF-8 text ({exc.reason})") from None


def exit_status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with {code}"


def last_words(stderr: bytes) -> str:
    """': <its last line on stderr> (file.py:12)', the location from a Python traceback; '' when it said nothing."""
    text = stderr.decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    where = traceback_location(text)
    return f": {lines[-1][-LAST_WORDS_CHARS:]}" + (f" ({where})" if where else "")
