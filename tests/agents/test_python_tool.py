"""The python_tool workflow (``rollout.workflow=python_tool``): the environment under test is real (the
sandbox runs every program), the model is scripted where its turns must be known. A code turn is run and
its output comes back as masked context, the answer after it is scored, hostile programs are killed at
their limits while the episode goes on and leave no process behind, and one episode on the tiny model
through a real rollout server is recorded token for token."""

import asyncio
import os
from pathlib import Path

import pytest

from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, Sampling, Scorer
from areal_hpc.agents.groups import run_episode
from areal_hpc.agents.python_tool import PythonToolWorkflow, code_blocks, observation
from areal_hpc.agents.registry import build_workflow
from areal_hpc.builtins import POINTS
from areal_hpc.config import load_config
from areal_hpc.data import arithmetic
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.tasks import Example
from areal_hpc.models.chat import completion_ids, next_turn_ids, prompt_ids
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.reward.sandbox import SandboxResult, _descendants
from areal_hpc.rollout.client import Generation, RolloutClient
from tests.conftest import embedded_server
from tests.workflow_helpers import ScriptedModel, episode_groups

EXAMPLE = Example("arithmetic/eval/0", "What is 6*7?", "42", "42")


def code(program: str) -> str:
    return f"Let me compute it.\n```python\n{program}\n```"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def pool():
    with RewardPool(arithmetic.reward) as pool:
        yield pool


def scripted_episode(tokenizer, pool, turns: list[str], **workflow_args):
    model = ScriptedModel(tokenizer, turns)
    engine = EpisodeContext(
        EpisodeSettings(generate=model, tokenizer=tokenizer, sampling=Sampling(32), scorer=Scorer(pool))
    )
    [record] = asyncio.run(run_episode(PythonToolWorkflow(**workflow_args), engine, EXAMPLE))
    return model, engine, record


def test_code_turn_runs_and_its_output_is_masked_context_before_the_scored_answer(tokenizer, pool):
    model, engine, record = scripted_episode(tokenizer, pool, [code("print(6*7)"), "42"])
    call, answer = model.outputs
    tool = next_turn_ids(tokenizer, "tool", "42\n", call)
    first, second = record.segments
    assert (first.input_ids.tolist(), first.output_ids.tolist()) == (prompt_ids(tokenizer, EXAMPLE.prompt), call)
    assert (second.input_ids.tolist(), second.output_ids.tolist()) == (tool, answer)  # the tool's reply: input_ids
    assert "42" in tokenizer.decode(second.input_ids) and "<|im_start|>tool" in tokenizer.decode(second.input_ids)
    assert model.seen == [first.input_ids.tolist(), first.input_ids.tolist() + call + tool]  # what the model saw
    assert all(s.loss_mask.tolist() == [1] * len(s.output_ids) for s in record.segments)  # only model tokens train
    assert [(r.step, r.value) for r in record.rewards] == [(1, 1.0)] and record.reward == 1.0
    meta = record.metadata
    assert (meta["tool_calls"], meta["tool_kills"], meta["tool_killed_by"]) == (1, 0, [])
    assert engine.outcomes[0].error is None


HOSTILE = {
    "loop": "while True: pass",
    "fork": "import os; [os.fork() for _ in range(100)]",
    "memory": "x = bytearray(10**10)",
}


def programs_alive() -> set[int]:
    """This test process's descendants but the reward pool's workers (started whenever it first scores)."""
    alive = set()
    for pid in _descendants(os.getpid()):
        try:
            if b"multiprocessing" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                alive.add(pid)
        except OSError:  # ended meanwhile
            continue
    return alive


def test_hostile_programs_are_killed_and_the_episode_goes_on(tokenizer, pool):
    before = programs_alive()
    turns = [code(HOSTILE["loop"]), code(HOSTILE["fork"]), code(HOSTILE["memory"]), code("print(6*7)"), "42"]
    model, _, record = scripted_episode(tokenizer, pool, turns, max_turns=5, timeout_s=1.0)
    replies = [tokenizer.decode(s.input_ids) for s in record.segments[1:]]
    assert len(record.segments) == 5 and len(model.seen) == 5
    assert "killed: cpu" in replies[0] or "killed: wall_clock" in replies[0]
    assert "killed: processes" in replies[1] and "killed: memory" in replies[2]
    assert "42" in replies[3] and "killed" not in replies[3]
    assert record.metadata["tool_calls"] == 4 and record.metadata["tool_kills"] == 3
    assert record.metadata["tool_killed_by"][1:] == ["processes", "memory"]
    assert record.reward == 1.0  # the episode survived its programs and was scored
    assert programs_alive() <= before  # nothing a program started is alive


def test_an_episode_still_writing_code_scores_the_empty_answer(tokenizer, pool):
    model, engine, record = scripted_episode(tokenizer, pool, [code("print(1)"), code("print(42)")], max_turns=2)
    assert len(record.segments) == 2 and len(model.seen) == 2
    assert [(r.step, r.value) for r in record.rewards] == [(1, 0.0)]
    assert record.metadata["tool_calls"] == 1  # the last turn's program is not run: nobody would read it
    assert engine.outcomes[0].error is None


def test_a_turn_without_code_is_the_answer(tokenizer, pool):
    _model, _, record = scripted_episode(tokenizer, pool, ["It is 41."])
    assert len(record.segments) == 1 and record.reward == 0.0 and record.metadata["tool_calls"] == 0


def test_code_blocks_and_observations():
    assert code_blocks("42") is None and code_blocks("```\nprint(1)\n```") is None
    assert code_blocks("a\n```python\nx = 1\n```\nb\n```py\nprint(x)\n```") == "x = 1\n\nprint(x)\n"
    assert code_blocks("```Python3\nprint(1)") == "print(1)"  # cut off by max_new_tokens: run what is there
    result = SandboxResult(1, "o" * 1000, "Traceback\n" + "e" * 1000 + "\nValueError: x", False, None, 0.1, False)
    text = observation(result, 100)
    assert len(text) <= 100 and text.startswith("ooo") and text.endswith("ValueError: x")
    killed = SandboxResult(-9, "partial\n", "junk", True, "wall_clock", 1.0, False)
    assert observation(killed, 100) == "partial\nkilled: wall_clock"
    assert observation(SandboxResult(0, "", "", False, None, 0.1, False), 10) == "(no output)"


def test_the_config_builds_the_workflow():
    cfg = load_config("configs/agent_python_tool.yaml")
    assert POINTS["workflow"].builtins["python_tool"] == "areal_hpc.agents.python_tool:PythonToolWorkflow"
    workflow = build_workflow(cfg.rollout)
    assert isinstance(workflow, PythonToolWorkflow) and workflow.max_context_tokens == 1024
    assert cfg.dataset.task == "arithmetic" and cfg.dataset.arithmetic.ops == "*"
    with pytest.raises(ValueError):
        PythonToolWorkflow(max_turns=0)


class FirstTurnScripted:
    """A rollout client whose first turn of each episode is a scripted program (the random tiny model
    writes none); every later turn is the real server's. Keeps every generation it returned."""

    def __init__(self, client, prompt: list[int], first_turn: list[int]):
        self.client, self.prompt, self.first_turn, self.generations = client, prompt, first_turn, []

    async def generate(self, input_ids, params):
        if list(input_ids) == self.prompt:
            n = len(self.first_turn)
            generation = Generation(list(input_ids), list(self.first_turn), [-0.1] * n, [0] * n, "stop")
        else:
            generation = await self.client.generate(input_ids, params)
        self.generations.append(generation)
        return generation


def test_an_episode_on_the_tiny_model_through_a_real_server_is_recorded_exactly(
    tiny_model_dir, tokenizer, pool, tmp_path
):
    prompt = prompt_ids(tokenizer, EXAMPLE.prompt)

    async def run(address):
        async with RolloutClient([address]) as client:
            model = FirstTurnScripted(client, prompt, completion_ids(tokenizer, code("print(6*7)")))
            groups = episode_groups(
                tokenizer,
                pool,
                Sampling(max_new_tokens=24),
                2,
                PythonToolWorkflow(max_turns=2, timeout_s=1.0, max_context_tokens=1024),
            )
            return model.generations, await groups.run(model, EXAMPLE)

    with embedded_server(tiny_model_dir, tmp_path) as (_, address):
        generations, records = asyncio.run(run(address))
    served = [(g.input_ids, g.output_ids, g.versions) for g in generations]
    assert len(records) == 2 and len({r.group_id for r in records}) == 1
    for record in records:
        assert len(record.segments) == 2 and len(record.rewards) == 1 and record.reward in (0.0, 1.0)
        assert record.metadata["tool_calls"] == 1 and record.metadata["tool_kills"] == 0
        assert record.segments[0].input_ids.tolist() == prompt
        assert "42" in tokenizer.decode(record.segments[1].input_ids)  # the program's output, then the model's turn
        context: list[int] = []
        for segment in record.segments:
            context += segment.input_ids.tolist()
            output = segment.output_ids.tolist()
            served.remove((context, output, segment.output_versions.tolist()))  # what was asked, token for token
            assert 0 < len(output) == len(segment.output_logprobs) and (segment.output_logprobs <= 0).all()
            context = context + output
        assert len(record.segments[1].output_ids) <= 24  # the server's turn, at its max_new_tokens
    assert served == []  # and every generation is in a record
