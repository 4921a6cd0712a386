"""The calculator agent (``rollout.workflow=calculator``, ``dataset.task=calculator``,
``configs/agent_calculator.yaml``): the tool never raises whatever the model writes, a tool episode's
record is exactly the tokens the model saw (the tool's replies as masked context), the reward, the
task's SFT demonstrations, and the demo config training end to end."""

import asyncio
import json
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.agents.calculator import MAX_EXPRESSION_CHARS, CalculatorWorkflow, calculate, run_tool, tool_call
from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, Sampling, Scorer
from areal_hpc.agents.groups import run_episode
from areal_hpc.builtins import POINTS
from areal_hpc.config import ArithmeticConfig, DatasetConfig, load_config
from areal_hpc.data import calculator
from areal_hpc.data.registry import build_task, corpus_for_tokenizer
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.tasks import Example
from areal_hpc.models.chat import next_turn_ids, prompt_ids
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.rollout.client import RolloutClient
from tests.conftest import embedded_server, run_cli
from tests.workflow_helpers import ScriptedModel

REPLY = re.compile(r"<result>-?\d+</result>|<error>[^<>]*</error>")


@pytest.mark.parametrize(
    "turn, reply",
    [
        ("<calc>482*3712</calc>", "<result>1789184</result>"),
        ("  <calc> (12 + 3) * -4 - 5 </calc>\n", "<result>-65</result>"),
        ("<calc>0*9999</calc>", "<result>0</result>"),
    ],
)
def test_a_tool_call_is_evaluated(turn, reply):
    assert run_tool(tool_call(turn)) == reply


@pytest.mark.parametrize(
    "turn",
    [
        "<calc>12*34",
        "<calc></calc>",
        "<calc>1+</calc>",
        "<calc>12*34</calc></calc>",
        "<calc>1/2</calc>",
        "<calc>2**10</calc>",
        "<calc>9**9**9**9</calc>",
        "<calc>1.5*2</calc>",
        "<calc>True*3</calc>",
        "<calc>0x10</calc>",
        "<calc>__import__('os').system('true')</calc>",
        "<calc>open('/etc/passwd')</calc>",
        "<calc>[1]*10**9</calc>",
        "<calc>x*2</calc>",
        "<calc>(lambda: 1)()</calc>",
        "<calc>\x00</calc>",
        "<calc>1_000*2</calc>",
        "<calc>" + "(" * 500 + "1" + ")" * 500 + "</calc>",
        "<calc>" + "9" * 30 + "</calc>",
        "<calc>" + "*".join(["999999999999"] * 5) + "</calc>",
        "<calc>" + "1+" * 5000 + "1</calc>",
    ],
)
def test_malformed_hostile_and_huge_calls_are_error_observations(turn):
    call = tool_call(turn)
    assert call is not None  # a call, however bad: the episode goes on with an error to read
    assert run_tool(call).startswith("<error>") and REPLY.fullmatch(run_tool(call))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=2 * MAX_EXPRESSION_CHARS) | st.from_regex(r"[-+*() 0-9]{0,80}", fullmatch=True))
def test_the_tool_never_raises(expression):
    reply = run_tool(expression)
    assert REPLY.fullmatch(reply)
    if reply.startswith("<result>"):
        assert int(reply[8:-9]) == eval(expression.strip(), {"__builtins__": {}})  # only + - * of integers got through


def test_only_a_turn_that_opens_with_the_tag_is_a_call():
    assert tool_call("1789184") is None and tool_call("it is 5 <calc>2*3</calc>") is None
    assert tool_call("<calc>2*3</calc>") == "2*3" and calculate("2*3") == 6


def test_reward_checks_the_answer_and_reports_tool_use():
    after_tool = "<|im_start|>tool\n<result>1789184</result><|im_end|>\n<|im_start|>assistant\n"
    assert calculator.reward("What is 482*3712?", "1789184", [], [], answer="1789184") == {
        "reward": 1.0,
        "tool_used": 0.0,
    }
    assert calculator.reward(after_tool, "1789184", [], [], answer="1789184") == {"reward": 1.0, "tool_used": 1.0}
    assert calculator.reward(after_tool, "1789185", [], [], answer="1789184")["reward"] == 0.0
    assert calculator.reward("q", "<calc>1789184</calc>", [], [], answer="1789184")["reward"] == 0.0


def test_task_mixes_sft_demonstrations_and_holds_out_plain_questions():
    cfg = load_config("configs/agent_calculator.yaml", ["dataset.train_size=4000"])
    task = build_task(cfg.dataset)
    assert "calculator" in POINTS["task"].builtins and "calculator" in POINTS["workflow"].builtins
    assert task.name == "calculator"
    assert len(task.eval) == cfg.dataset.eval_size and all(not ex.messages for ex in task.eval)
    for ex in task.eval + task.train:
        a, b = map(int, re.fullmatch(r"What is (\d+)\*(\d+)\?", ex.prompt).groups())
        assert 100 <= a <= 9999 and 100 <= b <= 9999 and ex.answer == str(a * b)
    kinds = Counter()
    for ex in task.train:
        if ex.messages:
            kinds["read"] += 1
            assert [m["role"] for m in ex.messages] == ["user", "assistant", "tool"]
            assert ex.messages[1]["content"] == f"<calc>{ex.prompt[8:-1]}</calc>"
            assert ex.messages[2]["content"] == f"<result>{ex.answer}</result>" and ex.target == ex.answer
        else:
            kinds["call" if ex.target.startswith("<calc>") else "direct"] += 1
            assert ex.target in (ex.answer, f"<calc>{ex.prompt[8:-1]}</calc>")
    for kind, share in calculator.DEMO_SHARES.items():
        assert kinds[kind] / len(task.train) == pytest.approx(share, abs=0.03)
    assert any("<calc>" in line for line in corpus_for_tokenizer(0))  # the tokenizer learns the tag


def ids(array) -> list[int]:
    return [int(v) for v in array]


EXAMPLE = Example("calculator/eval/0", "What is 482*3712?", "1789184", "1789184")


def scripted_episode(tokenizer, pool, turns: list[str], max_turns: int = 3):
    model = ScriptedModel(tokenizer, turns)
    engine = EpisodeContext(EpisodeSettings(model, tokenizer, Sampling(max_new_tokens=16), Scorer(pool)))
    [record] = asyncio.run(run_episode(CalculatorWorkflow(max_turns), engine, EXAMPLE))
    return model, record


def test_tool_episode_record_is_exact(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    with RewardPool(calculator.reward) as pool:
        model, record = scripted_episode(tokenizer, pool, ["<calc>482*3712</calc>", "1789184"])
    call, answer = model.outputs
    tool = next_turn_ids(tokenizer, "tool", "<result>1789184</result>", call)
    first, second = [(ids(s.input_ids), ids(s.output_ids)) for s in record.segments]
    assert first == (prompt_ids(tokenizer, EXAMPLE.prompt), call)
    assert second == (tool, answer)  # the tool's reply: context, not trained on
    assert model.seen == [first[0], first[0] + call + tool]  # exactly what the model saw
    assert tokenizer.decode(tool) == "\n<|im_start|>tool\n<result>1789184</result><|im_end|>\n<|im_start|>assistant\n"
    assert [(r.step, r.value) for r in record.rewards] == [(1, 1.0)] and record.reward == 1.0
    assert record.metadata["reward_metrics"] == {"tool_used": 1.0}


def test_bad_calls_get_errors_and_an_episode_without_an_answer_scores_zero(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    with RewardPool(calculator.reward) as pool:
        _model, record = scripted_episode(tokenizer, pool, ["<calc>2**99</calc>", "<calc>1+", "<calc>2*3</calc>"])
        direct_model, direct = scripted_episode(tokenizer, pool, ["12"])
    replies = [tokenizer.decode(s.input_ids) for s in record.segments[1:]]
    assert "<error>only integers, + - * and parentheses</error>" in replies[0] and "<error>malformed call" in replies[1]
    assert len(record.segments) == 3 and [(r.step, r.value) for r in record.rewards] == [(2, 0.0)]
    assert len(direct.segments) == 1 and direct.reward == 0.0 and len(direct_model.seen) == 1


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model after a few SFT steps on tool calls only: it opens every first turn with <calc>."""
    import torch

    from areal_hpc.config import OptimizerConfig
    from areal_hpc.engines.torch.engine import TorchTrainEngine
    from areal_hpc.engines.torch.outputs import packed_policy_outputs
    from areal_hpc.models.hf import load_model, save_model
    from areal_hpc.train.sft import sft_sequences, sft_step

    torch.manual_seed(0)
    tokenizer, model = load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    cfg = DatasetConfig(
        task="calculator", train_size=256, eval_size=1, arithmetic=ArithmeticConfig(min_digits=3, max_digits=4, ops="*")
    )
    calls = [calculator.demonstration(ex, "call") for ex in build_task(cfg).train]
    engine = TorchTrainEngine(
        model,
        packed_policy_outputs,
        optimizer=OptimizerConfig(lr_scheduler_type="constant"),
        lr=3e-3,
        total_steps=40,
        tokenizer=tokenizer,
    )
    for step in range(40):
        sft_step(engine, [pair for ex in calls[(step * 32) % 256 :][:32] for pair in sft_sequences(tokenizer, ex)])
    return save_model(model, tokenizer, tmp_path_factory.mktemp("tool_model") / "model")


def test_served_tool_episode_records_exactly_what_the_server_saw(tool_model_dir, tmp_path):
    """A real rollout server and a model that calls the tool: every turn's request is the record so far."""
    tokenizer = load_tokenizer(tool_model_dir)

    async def run(address):
        async with RolloutClient([address]) as client:
            with RewardPool(calculator.reward) as pool:
                engine = EpisodeContext(
                    EpisodeSettings(client.generate, tokenizer, Sampling(16, temperature=0.0), Scorer(pool))
                )
                return engine, await run_episode(CalculatorWorkflow(max_turns=3), engine, EXAMPLE)

    with embedded_server(tool_model_dir, tmp_path) as (_, address):
        engine, [record] = asyncio.run(run(address))
    assert len(record.segments) >= 2 and engine.decode(record.segments[0].output_ids).startswith("<calc>")
    context: list[int] = []
    for segment, generation in zip(record.segments, engine.generations, strict=True):
        context += ids(segment.input_ids)
        assert generation.input_ids == context  # the server saw the record so far, token for token
        context += ids(segment.output_ids)
        assert len(segment.output_logprobs) == len(segment.output_ids) > 0
    for segment in record.segments[1:]:
        assert REPLY.search(tokenizer.decode(segment.input_ids))  # the tool's reply is masked context
        assert "<result>" not in engine.decode(segment.output_ids)


@pytest.mark.slow
def test_agent_calculator_config_trains_end_to_end(tmp_path):
    out = run_cli(
        "train",
        "--config",
        "configs/agent_calculator.yaml",
        f"cluster.fileroot={tmp_path}",
        "rl.sft_warmup_steps=60",
        "rl.total_train_steps=4",
        "rl.eval_every_steps=2",
        "dataset.eval_size=16",
        "dataset.train_size=2000",
        "saver.freq_steps=0",
        "rollout.consumer_batch_size=4",
        "generation.n_samples=4",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "agent_calculator" / "trial0" / "metrics.jsonl").open()]
    accuracy = {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
    assert sorted(accuracy) == [0, 2, 4] and all(0.0 <= a <= 1.0 for a in accuracy.values())
    turns = [r["rollout/turns"] for r in records if "rollout/turns" in r]
    assert len(turns) == 4 and max(turns) > 1  # sampled episodes called the tool
    assert any("reward/tool_used" in r for r in records)
