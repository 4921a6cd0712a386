"""The calculator agent (``rollout.workflow=agents_sdk``: the OpenAI Agents SDK and its calculator tool) on a
Qwen3-template model that writes its own ``<think>`` and ``<tool_call>``: a small Qwen3 taught two calculator
conversations by SFT (``train.sft``: the demonstrations in OpenAI's form, rendered with the SDK's tools as
``areal-hpc sft`` renders them), decoded greedily by the embedded rollout server. Behind the
login-node proxy on loopback, through the real ``openai`` client, the proxy returns the model's reasoning and
call as ``reasoning_content`` and ``tool_calls``, the SDK runs the tool and sends its result back as a ``tool``
message, the model answers from it, and the stored record is the one conversation, training exactly the
model's tokens; in a training run's episode (``arun_episode`` on the in-process chat client) it is one
rewarded record too."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from areal_hpc.agents.chat import ChatGateway
from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, Sampling, Scorer
from areal_hpc.agents.groups import run_episode
from areal_hpc.agents.sdk_agent import INSTRUCTIONS, AgentsSDKWorkflow, calculate
from areal_hpc.config import OptimizerConfig
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.shards import TrajectoryStore
from areal_hpc.data.tasks import Example
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import packed_policy_outputs
from areal_hpc.models.hf import load_model, save_model
from areal_hpc.models.tokenizer import build_tokenizer
from areal_hpc.proxy.chat_template import ChatTokenizer
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.rollout.embedded_engine import EmbeddedGenerator
from areal_hpc.rollout.server import build_app
from areal_hpc.train.sft import sft_sequences, sft_step
from areal_hpc.train.trajectory_batch import trajectory_sequence
from tests import rewards_for_tests
from tests.proxy_helpers import call, proxy_config, running_proxy, serving, start_session, write_keys
from tests.train.test_demonstrations import trained_turns

QUESTIONS = [(12, "*", 34), (56, "+", 78)]
REASONING = "Use the calculator."
SFT_STEPS = 100  # every taught token is the greedy choice from about step 70 (lr 1e-2; 55 at the earliest)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The model's steps are small: one torch thread (two spin against each other and the servers' threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sdk_tools() -> list[dict]:
    """The calculator agent's tools as the SDK sends them."""
    from agents.models.chatcmpl_converter import Converter

    return [Converter.tool_to_openai(tool) for tool in AgentsSDKWorkflow().tools]


def demonstration(a: int, op: str, b: int) -> Example:
    """One question's SFT demonstration in OpenAI's form, with the tools the SDK sends: the agent's messages and
    the model's two turns (think, call the calculator; think about its result, answer). The agent sends the call
    back with its reasoning (``sdk_agent.replay_reasoning``), which Qwen3's template writes where the model
    wrote it."""
    arguments = json.dumps({"a": a, "op": op, "b": b})
    result = calculate(float(a), op, float(b))  # the SDK hands the tool floats: "408.0"
    tool_call = {"id": "call", "type": "function", "function": {"name": "calculate", "arguments": arguments}}
    messages = (
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": f"What is {a}{op}{b}?"},
        {"role": "assistant", "content": "", "reasoning_content": REASONING, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "call", "content": result},
        {"role": "assistant", "content": str(int(float(result))), "reasoning_content": f"The tool says {result}."},
    )
    return Example(f"demos.jsonl/{a}{op}{b}", "", messages=messages, tools=tuple(sdk_tools()))


def written_turns(a: int, op: str, b: int) -> list[str]:
    """The model's two turns as Qwen3 writes them, spelled out."""
    result = calculate(float(a), op, float(b))
    call = f'<tool_call>\n{{"name": "calculate", "arguments": {json.dumps({"a": a, "op": op, "b": b})}}}\n</tool_call>'
    return [
        f"<think>\n{REASONING}\n</think>\n\n{call}<|im_end|>",
        f"<think>\nThe tool says {result}.\n</think>\n\n{int(float(result))}<|im_end|>",
    ]


@pytest.fixture(scope="module")
def qwen3_calculator(tmp_path_factory):
    """A Qwen3 (two layers, a tokenizer of Qwen3's family trained on the conversations) taught the
    demonstrations by SFT as ``areal-hpc sft`` renders them: (its folder, its tokenizer, each question's
    (context ids, turn ids) per model turn)."""
    demos = [demonstration(*question) for question in QUESTIONS]
    draft = build_tokenizer(["What is"], family="qwen3")  # renders the template's text to train the real one on
    tokenizer = build_tokenizer(
        [draft.apply_chat_template(list(d.messages), tools=list(d.tools), tokenize=False) for d in demos],
        family="qwen3",
    )
    folder = tmp_path_factory.mktemp("qwen3_calculator") / "model"
    tokenizer.save_pretrained(folder)
    sequences = [pair for demo in demos for pair in sft_sequences(tokenizer, demo, ChatTokenizer(folder))]
    for question, (ids, mask) in zip(QUESTIONS, sequences, strict=True):  # one record each: reasoning replayed
        assert [tokenizer.decode(turn) for _, turn in trained_turns(ids, mask)] == written_turns(*question)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    engine = TorchTrainEngine(
        model,
        packed_policy_outputs,
        optimizer=OptimizerConfig(lr_scheduler_type="constant"),
        lr=1e-2,
        total_steps=SFT_STEPS,
        tokenizer=tokenizer,
    )
    for _ in range(SFT_STEPS):
        sft_step(engine, sequences)
    with torch.no_grad():
        for ids, mask in sequences:
            greedy = model.eval()(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
            taught = [(said, token) for said, token, trained in zip(greedy, ids[1:], mask[1:]) if trained]
            assert all(said == token for said, token in taught), f"SFT did not teach {demos} in {SFT_STEPS} steps"
    save_model(model, tokenizer, folder)
    return folder, tokenizer, {question: trained_turns(*sequence) for question, sequence in zip(QUESTIONS, sequences)}


@pytest.fixture(scope="module")
def served(qwen3_calculator, tmp_path_factory):
    """The model behind the embedded rollout server (greedy where asked) and the login-node proxy, both on
    loopback: (the server's address, the proxy's base url, the proxy's shards folder)."""
    folder, tokenizer, _ = qwen3_calculator
    root = tmp_path_factory.mktemp("served")
    write_keys(root / "keys.yaml", {"alice": {"keys": ["tk-alice"]}})
    engine = EmbeddedGenerator(load_model(folder), slots=2)
    try:
        with serving(build_app(engine, str(folder), tokenizer)) as (server, _):
            address = server.removeprefix("http://")
            cfg = proxy_config(
                folder, root / "runs", [address], root / "keys.yaml", f"proxy.shards_dir={root / 'shards'}"
            )
            with running_proxy(cfg) as (base, _, _):
                yield address, base, root / "shards"
    finally:
        engine.stop()


def run_agent(client: openai.AsyncOpenAI, question: str):
    """The calculator agent on ``client``, asked ``question``, decoding greedily: the SDK's run result."""
    workflow = AgentsSDKWorkflow(max_turns=3)

    async def run():
        async with client:
            agent = workflow.agent(client, "tiny").clone(model_settings=workflow.sdk.ModelSettings(temperature=0.0))
            return await workflow.sdk.Runner.run(agent, question, max_turns=workflow.max_turns)

    return asyncio.run(run())


@pytest.mark.parametrize("question", QUESTIONS, ids=lambda q: "".join(map(str, q)))
def test_the_calculator_agent_thinks_calls_the_tool_and_answers_through_the_proxy(question, qwen3_calculator, served):
    _, tokenizer, taught = qwen3_calculator
    _, base, shards = served
    (asked, call_ids), (called, answer_ids) = taught[question]
    a, op, b = question
    result_text = calculate(float(a), op, float(b))
    session_id, key = start_session(base, "tk-alice")
    result = run_agent(openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0), f"What is {a}{op}{b}?")

    # the proxy's replies as the SDK read them: reasoning apart, the call parsed, the tool run, the answer
    items = result.new_items
    kinds = ["reasoning_item", "tool_call_item", "tool_call_output_item", "reasoning_item", "message_output_item"]
    assert [item.type for item in items] == kinds
    assert [item.raw_item.summary[0].text for item in items if item.type == "reasoning_item"] == [
        REASONING,
        f"The tool says {result_text}.",
    ]
    (tool_call,) = [item.raw_item for item in items if item.type == "tool_call_item"]
    assert (tool_call.name, json.loads(tool_call.arguments)) == ("calculate", {"a": a, "op": op, "b": b})
    assert [item.output for item in items if item.type == "tool_call_output_item"] == [result_text]
    assert result.final_output == str(int(float(result_text)))

    assert call(base, "/rl/set_reward", {"reward": 1.0}, key)[0] == 200
    assert call(base, "/rl/end_session", {}, key)[0] == 200
    with TrajectoryStore(shards) as store:
        (record,) = [t for t in store.trajectories() if t.session_id == session_id]
    first, second = record.segments
    assert first.input_ids.tolist() == asked  # the SDK's request rendered as transformers renders the demonstration
    assert first.output_ids.tolist() == call_ids and second.output_ids.tolist() == answer_ids  # what the model wrote
    assert asked + call_ids + second.input_ids.tolist() == called  # the call went back with its reasoning
    assert tokenizer.decode(second.input_ids, skip_special_tokens=False) == (
        f"\n<|im_start|>user\n<tool_response>\n{result_text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    tokens, mask, _, _ = trajectory_sequence(record, 1.0)
    assert [t for t, trained in zip(tokens, mask) if trained] == call_ids + answer_ids
    assert record.reward == 1.0 and [r.step for r in record.rewards] == [1]


def test_a_training_episode_of_the_calculator_agent_is_one_rewarded_record(qwen3_calculator, served):
    """``arun_episode`` as a run calls it (the in-process chat client over the rollout server): the call's
    turn and the answer's are one record, so the reward reaches the call too."""
    folder, tokenizer, taught = qwen3_calculator
    address, _, _ = served
    (_, call_ids), (_, answer_ids) = taught[QUESTIONS[0]]

    async def run():
        async with RolloutClient([address]) as rollout, ChatGateway(rollout.generate, folder) as chat:
            with RewardPool(rewards_for_tests.exact_answer, workers=0) as pool:
                settings = EpisodeSettings(
                    rollout.generate, tokenizer, Sampling(64, temperature=0.0), Scorer(pool), chat
                )
                example = Example("q", "What is 12*34?", answer="408")
                return await run_episode(AgentsSDKWorkflow(max_turns=3), EpisodeContext(settings), example)

    (record,) = asyncio.run(run())
    assert [s.output_ids.tolist() for s in record.segments] == [call_ids, answer_ids]
    assert record.reward == 1.0 and [r.step for r in record.rewards] == [1]
