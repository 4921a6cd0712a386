"""Your task, your reward, your agent, as a user brings them: a project outside the package (Parquet
data, a reward by file path, an agent class on the ``openai`` client) trains through ``areal-hpc train``;
an agent's records are the tokens its conversation renders to, with everything the environment said
(tool output, user turns) outside the loss (hypothesis, through the real ``openai`` client); an agent
written with the OpenAI Agents SDK trains unchanged; bad user code is one line."""

import asyncio
import json
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hpc.agents.chat import ChatGateway
from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, Sampling, Scorer
from areal_hpc.agents.groups import run_episode
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.shards.reader import TrajectoryStore
from areal_hpc.data.tasks import Example
from areal_hpc.models.hf import load_model, load_tokenizer
from areal_hpc.proxy.chat_template import ChatTokenizer
from areal_hpc.rollout.client import Generation
from areal_hpc.rollout.embedded_engine import EmbeddedGenerator, SamplingParams
from tests import rewards_for_tests
from tests.conftest import REPO, run_cli
from tests.system.test_async_rl import SMALL_RUN, metrics
from tests.user_project import write_project
from tests.workflow_helpers import memorise


class InProcessModel:
    """The tiny model decoded in this process (the embedded servers' engine), as a ``generate``."""

    def __init__(self, model_dir):
        tokenizer = load_tokenizer(model_dir)
        self.engine = EmbeddedGenerator(load_model(model_dir), slots=8, eos_token_ids=[tokenizer.eos_token_id])

    async def generate(self, input_ids, params) -> Generation:
        result = await self.engine.generate(uuid.uuid4().hex, input_ids, SamplingParams.from_json(params))
        return Generation(list(input_ids), result.output_ids, result.logprobs, result.versions, result.finish_reason)


@pytest.fixture(scope="module")
def in_process(tiny_model_dir):
    model = InProcessModel(tiny_model_dir)
    yield model
    model.engine.stop()


class Conversation:
    """An agent whose environment says scripted things between the model's turns (as a tool or user)."""

    def __init__(self, replies: list[tuple[str, str]], max_tokens: int):
        self.replies, self.max_tokens = replies, max_tokens
        self.messages: list[dict] = []

    async def arun_episode(self, engine, example):
        client = engine.openai_client()
        self.messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": example.prompt}]
        for role, content in [*self.replies, (None, None)]:
            reply = await client.chat.completions.create(
                model=engine.model_name, messages=self.messages, max_tokens=self.max_tokens, temperature=0.7
            )
            self.messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            if role is not None:
                self.messages.append({"role": role, "content": content})
        client.set_reward(1.0)
        return None


MARKER = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=10, max_size=10).map(lambda s: f"ENV{s}")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    replies=st.lists(st.tuples(st.sampled_from(["tool", "user"]), MARKER), max_size=4), max_tokens=st.integers(1, 12)
)
def test_an_openai_agents_record_is_its_conversation_and_the_environment_is_outside_the_loss(
    in_process, tiny_model_dir, replies, max_tokens
):
    agent = Conversation(replies, max_tokens)
    tokenizer = load_tokenizer(tiny_model_dir)

    async def run():
        with RewardPool(rewards_for_tests.exact_answer) as pool:
            async with ChatGateway(in_process.generate, tiny_model_dir) as chat:
                settings_ = EpisodeSettings(in_process.generate, tokenizer, Sampling(8), Scorer(pool), chat)
                return await run_episode(agent, EpisodeContext(settings_), Example("q", "What is 2+3?", answer="5"))

    [record] = asyncio.run(run())
    assert len(record.segments) == len(replies) + 1 and record.reward == 1.0
    ids = np.concatenate([np.concatenate([s.input_ids, s.output_ids]) for s in record.segments]).tolist()
    # the re-tokenised conversation: what the template renders of it, each assistant turn as the model wrote
    # it (the client's text drops special tokens a random model may emit), closed as the model closed the last
    outputs = iter(s.output_ids.tolist() for s in record.segments)
    written = [
        {**m, "content": tokenizer.decode(_without_eos(next(outputs), tokenizer), skip_special_tokens=False)}
        if m["role"] == "assistant"
        else m
        for m in agent.messages
    ]
    assert [m["content"] for m in agent.messages if m["role"] == "assistant"] == [
        tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in record.segments
    ]
    rendered = ChatTokenizer(tiny_model_dir).render(written, add_generation_prompt=False)
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    assert rendered.startswith(decoded) and rendered[len(decoded) :] in ("", "\n", "<|im_end|>\n")
    for _, marker in replies:  # what the environment said is context, never a trained token
        assert any(marker in tokenizer.decode(s.input_ids) for s in record.segments)
        assert not any(marker in tokenizer.decode(s.output_ids) for s in record.segments)
    assert all(s.loss_mask.all() and len(s.output_logprobs) == len(s.output_ids) for s in record.segments)
    assert all(s.temperature == 0.7 for s in record.segments)


def test_an_episodes_client_is_answered_in_process_as_the_proxy_answers(in_process, tiny_model_dir):
    """The recording client's requests never leave the process, and get what the proxy's HTTP routes
    give: streamed and plain chats and completions recorded as turns, OpenAI's errors (wrong model, bad
    field, a route an episode does not have) with no turn kept, and a request cancelled mid-generation
    taking its turn back out."""
    import openai

    tokenizer = load_tokenizer(tiny_model_dir)
    started = asyncio.Event()

    async def generate(input_ids, params):
        if params["max_new_tokens"] == 11:  # the request this test cancels: it waits inside its turn
            started.set()
            await asyncio.Event().wait()
        return await in_process.generate(input_ids, params)

    async def run():
        async with ChatGateway(generate, tiny_model_dir) as chat:
            client = chat.client({})
            ask = {"model": chat.model_name, "messages": [{"role": "user", "content": "What is 2+3?"}]}
            chunks = [c async for c in await client.chat.completions.create(**ask, max_tokens=5, stream=True)]
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            plain = await client.completions.create(model=chat.model_name, prompt="2+3=", max_tokens=4)
            errors = []
            for call in (
                client.chat.completions.create(**{**ask, "model": "other"}),
                client.chat.completions.create(**ask, max_tokens=0),
                client.models.list(),
            ):
                with pytest.raises(openai.APIStatusError) as caught:
                    await call
                errors.append((caught.value.status_code, caught.value.code))
            cancelled = asyncio.create_task(client.chat.completions.create(**ask, max_tokens=11))
            await started.wait()
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            return streamed, plain, errors, client.session.turns

    streamed, plain, errors, turns = asyncio.run(run())
    assert len(turns) == 2  # the stream and the completion; no error and not the cancelled request
    assert streamed == tokenizer.decode(turns[0].output_ids, skip_special_tokens=True)
    assert plain.choices[0].text == tokenizer.decode(turns[1].output_ids, skip_special_tokens=True)
    assert errors == [(404, "model_not_found"), (400, "invalid_value"), (404, None)]


TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
    },
}


def _messages(form: str):
    """One conversation in the forms agents send it: dicts, a tuple, a generator, the SDK's own message
    model from an earlier reply, content as text parts."""
    from openai.types.chat import ChatCompletionMessage

    dicts = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4+4?"},
    ]
    return {
        "dicts": dicts,
        "tuple": tuple(dicts),
        "generator": (m for m in dicts),
        "model": [dicts[0], ChatCompletionMessage(role="assistant", content="5"), dicts[2]],
        "parts": [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in dicts],
    }[form]


CHAT_FIELDS = st.fixed_dictionaries(
    {"messages_form": st.sampled_from(["dicts", "tuple", "generator", "model", "parts"])},
    optional={
        "model": st.sampled_from(["other", None]),
        "max_tokens": st.integers(-1, 6),
        "max_completion_tokens": st.integers(1, 6),
        "logprobs": st.booleans(),
        "temperature": st.sampled_from([0, 5]),
        "n": st.integers(1, 2),
        "stop": st.sampled_from(["x", None]),
        "user": st.text(max_size=5),
        "tools": st.sampled_from([[TOOL], [None], [1], [{"type": "function", "function": {}}]]),
        "tool_choice": st.sampled_from(["auto", "none", "garbage"]),
        "extra_body": st.sampled_from([{}, {"top_p": 0.5}, {"seed": "abc"}, {"temperature": 0}]),
    },
)
COMPLETION_FIELDS = st.fixed_dictionaries(
    {"prompt": st.sampled_from(["2+3=", [5, 6, 7], [], [-1], 3])},
    optional={
        "max_tokens": st.integers(0, 6),
        "logprobs": st.integers(-1, 2),
        "model": st.just("other"),
        "extra_body": st.sampled_from([{}, {"top_p": 0.5}]),
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["chat", "completion"]), data=st.data())
def test_a_plain_create_answers_as_the_sdks_own_http_path(in_process, tiny_model_dir, route, data):
    """A plain ``create`` skips the SDK's request machinery (agents/chat.py); the SDK's own path
    (``with_raw_response``: its parameter transform, HTTP client, response parsing) to the same routes
    is the reference: the same reply (greedy, so the same tokens) or the same error, field for field,
    over the forms agents send (message models, generators, text parts, extra_body) and bad values."""
    import openai

    fields = data.draw(CHAT_FIELDS if route == "chat" else COMPLETION_FIELDS)

    async def both():
        async with ChatGateway(in_process.generate, tiny_model_dir) as chat:
            client = chat.client({})
            resource = client.chat.completions if route == "chat" else client.completions
            request = {k: v for k, v in fields.items() if k != "messages_form"}
            request["model"] = request.get("model") or chat.model_name
            request.setdefault("temperature", 0)
            outcomes = []
            for create in (resource.create, resource.with_raw_response.create):
                if route == "chat":
                    request["messages"] = _messages(fields["messages_form"])  # a generator is read once
                try:
                    reply = await create(**request)
                    reply = reply.parse() if create != resource.create else reply
                    outcomes.append(("reply", type(reply), reply.model_dump(exclude={"id", "created"})))
                except openai.APIStatusError as exc:
                    outcomes.append(("error", type(exc), exc.status_code, exc.body))
            return outcomes, client.session.turns

    (fast, sdk), turns = asyncio.run(both())
    assert fast == sdk
    if fast[0] == "reply":
        assert (
            len(turns) == 2
            and turns[0].output_ids == turns[1].output_ids
            and turns[0].prompt_ids == turns[1].prompt_ids
        )
    else:
        assert turns == []


def test_a_client_with_other_options_records_into_the_same_episode(in_process, tiny_model_dir):
    """``with_options`` (what frameworks call to set a timeout or retries) keeps the episode's session."""
    from areal_hpc.agents.chat import RecordingOpenAI

    async def run():
        async with ChatGateway(in_process.generate, tiny_model_dir) as chat:
            client = chat.client({})
            other = client.with_options(timeout=5, max_retries=2)
            await other.chat.completions.create(
                model=chat.model_name, max_tokens=3, messages=[{"role": "user", "content": "What is 2+3?"}]
            )
            other.set_reward(1.0)
            return client, other, client.records()

    client, other, records = asyncio.run(run())
    assert isinstance(other, RecordingOpenAI) and other.session is client.session
    assert (other.timeout, other.max_retries, client.max_retries) == (5, 2, 0)
    assert len(records) == 1 and records[0].rewards[-1].value == 1.0


def _without_eos(ids: list[int], tokenizer) -> list[int]:
    return ids[:-1] if ids[-1:] == [tokenizer.eos_token_id] else ids


def test_an_agents_sdk_agent_runs_unchanged_and_its_turns_are_recorded(in_process, tiny_model_dir):
    from areal_hpc.agents.sdk_agent import AgentsSDKWorkflow

    tokenizer = load_tokenizer(tiny_model_dir)

    async def run():
        with RewardPool(rewards_for_tests.exact_answer) as pool:
            async with ChatGateway(in_process.generate, tiny_model_dir) as chat:
                settings_ = EpisodeSettings(in_process.generate, tokenizer, Sampling(6), Scorer(pool), chat)
                return await run_episode(
                    AgentsSDKWorkflow(), EpisodeContext(settings_), Example("q", "What is 2+3?", answer="5")
                )

    [record] = asyncio.run(run())
    prompt = tokenizer.decode(record.segments[0].input_ids, skip_special_tokens=False)
    assert "Use the calculator tool" in prompt and "What is 2+3?" in prompt  # the SDK's instructions and input
    assert record.metadata["example"] == "q" and record.rewards and record.rewards[-1].value == 0.0
    assert all(len(s.output_ids) <= 6 for s in record.segments)


@pytest.mark.slow
def test_a_users_project_trains_through_areal_hpc_train_without_touching_the_package(tmp_path):
    project = write_project(tmp_path / "project")
    overrides = [f"{k}={v}" for k, v in project.items()]
    result = run_cli(
        "train",
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        f"cluster.fileroot={tmp_path / 'runs'}",
        *SMALL_RUN,
        "rl.total_train_steps=3",
        "rl.eval_every_steps=0",
        "generation.max_new_tokens=6",
        "model.compute_dtype=float32",
        *overrides,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "quickstart" / "trial0"
    steps = [r for r in metrics(run) if "rollout/turns" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["rollout/turns"] == 2.0 and r["reward/unit_is_cm"] in (0.0, 0.25, 0.5, 0.75, 1.0) for r in steps)
    assert any("eval/accuracy" in r for r in metrics(run))
    with TrajectoryStore(run / "shards") as store:
        records = list(store.trajectories())
    tokenizer = load_tokenizer(run / "init_model")
    assert records and all(len(r.segments) == 2 for r in records)
    assert all("ruler says" in tokenizer.decode(r.segments[1].input_ids) for r in records)  # the tool's words: masked
    assert len({r.group_id for r in records}) == len(records) // 4  # generation.n_samples=4 episodes a group


@pytest.mark.parametrize(
    "override, words",
    [
        ("reward.fn=nowhere.py:reward", ["'reward.fn'", "no file", "nowhere.py"]),
        ("reward.fn=json:no_such", ["'reward.fn'", "has no 'no_such'"]),
        ("rollout.workflow=json:loads_", ["'rollout.workflow'", "has no 'loads_'"]),
        ("rollout.workflow=json:JSONDecoder", ["'rollout.workflow'", "no `async def arun_episode"]),
        ("dataset.prompt_field=title", ["'dataset.prompt_field'", "no column 'title'", "question, answer, unit"]),
        ("dataset.path=missing.parquet", ["'dataset.path'", "missing.parquet", "does not exist"]),
    ],
)
def test_bad_user_code_or_data_is_one_line_and_exit_2(tmp_path, override, words):
    project = write_project(tmp_path / "project")
    overrides = [f"{k}={v}" for k, v in project.items() if k != override.split("=")[0]]
    result = run_cli(
        "train",
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        f"cluster.fileroot={tmp_path / 'runs'}",
        *SMALL_RUN,
        *overrides,
        override,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert all(w in line for w in words), line


@given(n=st.integers(1, 8), data=st.data())
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_correct_one(n, data):
    """Against every k-subset of n samples, enumerated."""
    from itertools import combinations

    from areal_hpc.train.evaluate import pass_at_k

    c, k = data.draw(st.integers(0, n)), data.draw(st.integers(1, n))
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


class Raises:
    async def arun_episode(self, engine, example):
        raise KeyError("the agent's own bug")


def test_a_workflow_that_raises_is_counted_and_spends_the_failure_budget(tiny_model_dir):
    from areal_hpc.rollout.client import RolloutClient
    from areal_hpc.rollout.controller import FailureBudget, RolloutController, RolloutFailure
    from areal_hpc.rollout.staleness import StalenessGate
    from tests.workflow_helpers import episode_groups

    async def run():
        async with RolloutClient(["127.0.0.1:9"]) as client:  # never contacted: the agent fails first
            with RewardPool(rewards_for_tests.exact_answer) as pool:
                groups = episode_groups(load_tokenizer(tiny_model_dir), pool, Sampling(4), 2, Raises())
                controller = RolloutController(
                    client,
                    groups,
                    StalenessGate(2, 0, 2),
                    [Example(str(i), "q", answer="1") for i in range(8)],
                    budget=FailureBudget(max_consecutive=3),
                )
                await controller.start()
                with pytest.raises(RolloutFailure) as err:
                    await asyncio.wait_for(controller.prepare_batch(2), 60)
                await controller.stop()
                return err.value, controller

    error, controller = asyncio.run(run())
    assert "3 episodes in a row failed (workflow 3)" in str(error) and "KeyError" in str(error)
    assert (
        controller.failures.counts["workflow"] >= 3
        and controller.failures.total == controller.failures.counts["workflow"]
    )


@pytest.mark.slow
def test_eval_runs_a_users_workflow_with_samples_pass_at_k_and_writes_every_episode(tmp_path, tiny_model_dir):
    project = write_project(tmp_path / "project")
    out = tmp_path / "episodes.jsonl"
    result = run_cli(
        "eval",
        "--model",
        str(tiny_model_dir),
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        "--samples",
        "3",
        "--out",
        str(out),
        "--json",
        "generation.max_new_tokens=4",
        *[f"{k}={v}" for k, v in project.items()],
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["n"] == 4 and summary["samples"] == 3 and {"pass@1", "pass@2", "pass@3"} <= set(summary)
    assert summary["pass@1"] <= summary["pass@2"] <= summary["pass@3"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 12 and all(row["turns"] == 2 and row["reward"] in (0.0, 1.0) for row in rows)
    assert summary["mean_reward"] == pytest.approx(sum(r["reward"] for r in rows) / 12)


def test_a_model_without_a_chat_template_serves_no_client_and_says_why(tiny_model_dir, tmp_path):
    import shutil

    from areal_hpc.agents.chat import optional_chat
    from areal_hpc.errors import UserError

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)

    async def run():
        async with optional_chat(None, folder, 1.0) as chat:
            engine = EpisodeContext(EpisodeSettings(None, load_tokenizer(tiny_model_dir), Sampling(4), None, chat))
            with pytest.raises(UserError, match="serves no OpenAI client.*no chat template"):
                engine.openai_client()
            return engine.model_name

    assert asyncio.run(run()) == ""


TOOL_CALL = '<tool_call>{"name":"calculate","arguments":{"a":2,"op":"+","b":3}}</tool_call>'


@pytest.mark.slow
def test_an_agents_sdk_agent_calls_its_function_tool_and_the_tool_output_is_masked(tiny_model_dir, tmp_path):
    """A model that calls the SDK agent's tool (taught here, turn by turn, from the prompts the SDK
    really sends): the SDK runs the tool, the model answers from its result, and the record is the
    model's two turns with the tool's output between them as context."""
    import shutil

    import torch

    from areal_hpc.agents.sdk_agent import AgentsSDKWorkflow
    from tests.proxy.test_parts import TOOL_TEMPLATE

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tokenizer, model = load_tokenizer(folder), load_model(folder)
    torch.manual_seed(0)

    def episode(max_new_tokens: int):
        engine = EmbeddedGenerator(model, slots=2, eos_token_ids=[tokenizer.eos_token_id])

        async def generate(input_ids, params):
            result = await engine.generate(uuid.uuid4().hex, input_ids, SamplingParams.from_json(params))
            return Generation(
                list(input_ids), result.output_ids, result.logprobs, result.versions, result.finish_reason
            )

        async def run():
            with RewardPool(rewards_for_tests.exact_answer) as pool:
                async with ChatGateway(generate, folder) as chat:
                    settings_ = EpisodeSettings(
                        generate, tokenizer, Sampling(max_new_tokens, temperature=0.0), Scorer(pool), chat
                    )
                    return await run_episode(
                        AgentsSDKWorkflow(max_turns=3),
                        EpisodeContext(settings_),
                        Example("q", "What is 2+3?", answer="5"),
                    )

        try:
            [record] = asyncio.run(run())
        finally:
            engine.stop()
        return record

    call_length = len(tokenizer(TOOL_CALL + tokenizer.eos_token, add_special_tokens=False)["input_ids"])
    first_prompt = episode(1).segments[0].input_ids.tolist()  # what the SDK sends: instructions, tools, input
    memorise(model, tokenizer, [(first_prompt, TOOL_CALL)])
    called = episode(call_length)
    assert tokenizer.decode(called.segments[0].output_ids, skip_special_tokens=True) == TOOL_CALL
    second_prompt = np.concatenate(
        [called.segments[0].input_ids, called.segments[0].output_ids, called.segments[1].input_ids]
    ).tolist()
    memorise(model, tokenizer, [(first_prompt, TOOL_CALL), (second_prompt, "5")])

    record = episode(call_length)
    assert len(record.segments) == 2 and record.reward == 1.0
    call, answer = record.segments
    assert tokenizer.decode(call.output_ids, skip_special_tokens=True) == TOOL_CALL
    tool_output = tokenizer.decode(answer.input_ids, skip_special_tokens=False)
    assert "<|im_start|>tool\n5.0<|im_end|>" in tool_output  # the SDK ran calculate(2, "+", 3): context only
    assert tokenizer.decode(answer.output_ids, skip_special_tokens=True) == "5"
    assert not any("5.0" in tokenizer.decode(s.output_ids) for s in record.segments)


@pytest.mark.slow
def test_the_agents_sdk_config_trains_through_areal_hpc_train(tmp_path):
    result = run_cli(
        "train",
        "--config",
        str(REPO / "configs" / "agent_sdk.yaml"),
        f"cluster.fileroot={tmp_path}",
        *SMALL_RUN,
        "rl.total_train_steps=2",
        "rl.eval_every_steps=0",
        "dataset.eval_size=4",
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "agent_sdk" / "trial0"
    steps = [r for r in metrics(run) if "rollout/turns" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["train/trained_tokens"] > 0 for r in steps)
    with TrajectoryStore(run / "shards") as store:
        prompts = [load_tokenizer(run / "init_model").decode(t.segments[0].input_ids) for t in store.trajectories()]
    assert prompts and all("Use the calculator tool" in p for p in prompts)  # the SDK's instructions
