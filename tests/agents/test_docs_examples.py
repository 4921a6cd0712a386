"""The examples of the agent and reward pages run as written (docs/tutorials/agents.md,
docs/tutorials/task-and-reward.md, docs/rewards.md): each code block whose first line names a file is saved
there in a project folder with a small dataset, its YAML configs load and open their task through the
product, the rewards score real completions, the workflows run real episodes of the tiny model behind a
real rollout server (one for the module) whose records are checked token by token, evaluation decodes them
greedily, the warm-up demonstrations are token for token the records the agent makes, and every name the
page gives for what a workflow receives exists with the parameters it shows."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_hpc.agents.chat import ChatGateway, optional_chat
from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, Sampling, Scorer
from areal_hpc.agents.groups import EpisodeGroups, run_episode
from areal_hpc.agents.registry import build_workflow
from areal_hpc.agents.token_episode import TokenEpisode
from areal_hpc.builtins import load_object
from areal_hpc.config import absolute_path_overrides, load_config
from areal_hpc.data.rewards import RewardFunction, RewardPool, RewardRequest
from areal_hpc.data.tasks import Example
from areal_hpc.models.chat import prompt_ids
from areal_hpc.models.hf import load_model, load_tokenizer
from areal_hpc.rollout.client import Generation, RolloutClient
from areal_hpc.train.build import engine_settings
from areal_hpc.train.demonstrations import check_demonstrations, model_turns
from areal_hpc.train.evaluate import evaluate_model
from areal_hpc.train.sft import sft_sequences
from areal_hpc.train.task_setup import open_task, reward_pool
from areal_hpc.train.trajectory_batch import trajectory_sequence
from tests.conftest import REPO, embedded_server
from tests.models.test_chat import Says
from tests.train.test_demonstrations import trained_turns

PAGES = ["docs/tutorials/agents.md", "docs/tutorials/task-and-reward.md", "docs/rewards.md"]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
FILE_LINE = re.compile(r"# ([\w/.-]+\.(?:py|yaml))\n")
WORKFLOWS = ["workflows/my_agent.py:MyAgent", "workflows/sdk_agent.py:SDKAgent", "workflows/retry_agent.py:RetryAgent"]


def blocks(page: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of ``page``."""
    return BLOCK.findall((REPO / page).read_text())


def named_files() -> dict[str, str]:
    """Every block that names its file on its first line, by that name; pages that show one file agree on it."""
    files: dict[str, str] = {}
    for page in PAGES:
        for _, code in blocks(page):
            if (match := FILE_LINE.match(code)) is not None:
                assert files.setdefault(match[1], code) == code, f"{page} shows another {match[1]}"
    return files


def question(i: int) -> tuple[str, str]:
    a, b = 10 + 7 * i % 50, 3 + 11 * i % 40
    return f"What is {a}+{b}?", str(a + b)


def write_rows(path: Path, numbers: range) -> None:
    rows = [question(i) for i in numbers]
    pq.write_table(
        pa.table(
            {
                "question": [q for q, _ in rows],
                "answer": [a for _, a in rows],
                "solution": [a for _, a in rows],
                "messages": [
                    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}] for q, _ in rows
                ],
            }
        ),
        path,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The pages' files where they say, and the data their configs name (a chat column beside the text one)."""
    folder = tmp_path_factory.mktemp("project")
    for name, code in named_files().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(code)
    (folder / "data").mkdir()
    write_rows(folder / "data" / "train.parquet", range(24))
    write_rows(folder / "data" / "test.parquet", range(100, 104))
    return folder


def config(project: Path, name: str, *overrides: str):
    """The project's config ``name`` with ``overrides``, its relative paths made absolute (as ``submit``
    makes them) from the project folder."""
    with contextlib.chdir(project):
        relative = load_config(name, list(overrides))
        return load_config(name, [*overrides, *absolute_path_overrides(relative)])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with embedded_server(tiny_model_dir, tmp_path_factory.mktemp("server")) as (_, address):
        yield address


@pytest.fixture(scope="module")
def demos(project) -> Path:
    """The warm-up's demonstrations, made by the page's command."""
    subprocess.run(
        [sys.executable, "make_demos.py", "data/train.parquet", "data/test.parquet", "data/demos"],
        cwd=project,
        check=True,
        timeout=60,
    )
    return project / "data" / "demos"


@pytest.fixture(scope="module")
def rewards(project, tiny_model_dir, tokenizer):
    """The reward pool my_agent.yaml configures (its workers), shared by the module's episodes."""
    cfg = config(project, "my_agent.yaml", f"model.path={tiny_model_dir}")
    with reward_pool(cfg, open_task(cfg, tokenizer, tiny_model_dir), training=True) as pool:
        yield pool


def test_every_yaml_block_loads_and_opens_its_task(project, demos, tiny_model_dir, tokenizer):
    yamls = [name for name in named_files() if name.endswith(".yaml")]
    assert set(yamls) == {"my_agent.yaml", "my_task.yaml", "my_agent_sft.yaml"}
    for name in yamls:
        cfg = config(project, name, f"model.path={tiny_model_dir}")
        task = open_task(cfg, tokenizer, tiny_model_dir, say=lambda line: None)
        assert task.train and task.eval and build_workflow(cfg.rollout) is not None
        assert all(ex.target or model_turns(ex) for ex in task.train)  # each of them can warm up with SFT
    demos = open_task(config(project, "my_agent_sft.yaml", f"model.path={tiny_model_dir}"), tokenizer, tiny_model_dir)
    assert len(demos.train) == 24 and all(ex.messages for ex in demos.train + demos.eval)
    assert all(len(model_turns(ex)) == 2 and ex.tools for ex in demos.train)


def _request(tokenizer, completion: str, answer: str) -> RewardRequest:
    prompt = "What is 12+30?"
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    return RewardRequest(prompt, completion, prompt_ids(tokenizer, prompt), ids, {"answer": answer})


@pytest.mark.parametrize(
    "spec, completion, reward, metrics",
    [
        ("rewards/my_reward.py:score", "Let me see.\n42", 1.0, {"words": 4.0}),
        ("rewards/my_reward.py:score", "42\nor 43", 0.0, {"words": 3.0}),
        ("rewards/short_answer.py:reward", "It is 42", 1.0, {"tokens": None}),
        ("rewards/short_answer.py:reward", "42 " * 40 + "so 41", None, {"tokens": None}),
        ("rewards/batched.py:brevity", "42", None, {}),
    ],
)
def test_the_rewards_score_real_completions(project, tokenizer, spec, completion, reward, metrics):
    """Through the reward pool the run uses (in-process: the same calls, no worker to start)."""
    request = _request(tokenizer, completion, "42")
    tokens = len(request.completion_ids)
    expected = {
        "rewards/short_answer.py:reward": float(completion.strip().endswith("42")) - 0.01 * max(0, tokens - 32),
        "rewards/batched.py:brevity": 1.0 / (1 + tokens),
    }.get(spec, reward)
    with RewardPool(RewardFunction(f"{project / spec}"), workers=0) as pool:
        [outcome] = pool.score([request])
    assert outcome.error is None and outcome.value == pytest.approx(expected)
    assert outcome.metrics == {k: float(tokens) if v is None else v for k, v in metrics.items()}


def test_the_scripts_run_as_written(project):
    """Blocks that name no file are scripts (the sandbox's); they check what they show themselves."""
    scripts = [code for page in PAGES for lang, code in blocks(page) if lang == "python" and not FILE_LINE.match(code)]
    assert scripts
    for code in scripts:
        exec(compile(code, "<docs>", "exec"), {})


def _text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _check_records(records, example: Example, workflow: str, tokenizer, score) -> None:
    """Each episode's record: tokens, loss mask, and the reward ``score`` (the page's) gives its turns."""
    assert len({r.group_id for r in records}) == 1
    for record in records:
        first = tokenizer.decode(record.segments[0].input_ids, skip_special_tokens=False)
        user = example.chat_messages()[-1]["content"]
        assert user and user in first  # the question reached the model, for text and chat data
        for s in record.segments:
            assert len(s.output_ids) > 0 and s.loss_mask.all()
            assert len(s.loss_mask) == len(s.output_logprobs) == len(s.output_versions) == len(s.output_ids)
        assert "reward_error" not in record.metadata
        # the turns the reward scored: every turn of the token-level agent, the last (the answer) of the others
        scored = record.segments if workflow.endswith("RetryAgent") else record.segments[-1:]
        results = [score("", _text(tokenizer, s.output_ids), [], [], example.answer) for s in scored]
        assert record.reward == pytest.approx(sum(r["reward"] for r in results))
        words = record.metadata["reward_metrics"]["words"]
        assert words == pytest.approx(sum(r["words"] for r in results) / len(results))
        if workflow.endswith("RetryAgent"):  # the feedback between turns is context, never trained
            assert len(record.segments) == 8 or record.rewards[-1].value == 1.0  # workflow_args: {max_turns: 8}
            for s in record.segments[1:]:
                assert "not right" in tokenizer.decode(s.input_ids)
                assert "not right" not in _text(tokenizer, s.output_ids)


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
@pytest.mark.parametrize("workflow", WORKFLOWS)
def test_each_workflow_runs_real_episodes_behind_a_rollout_server(
    project, tiny_model_dir, tokenizer, server, rewards, workflow, chat
):
    """my_agent.yaml as written, with each workflow of the page: a group of episodes through the run's own
    settings (rollout client, chat gateway, sampling, reward pool)."""
    overrides = [f"model.path={tiny_model_dir}", f"rollout.workflow={workflow}"]
    cfg = config(project, "my_agent.yaml", *overrides, *(["dataset.prompt_field=messages"] if chat else []))
    task = open_task(cfg, tokenizer, tiny_model_dir)
    example = task.train[0]

    async def run():
        async with (
            RolloutClient([server]) as client,
            optional_chat(client.generate, tiny_model_dir, cfg.rollout.turn_discount) as chat_gateway,
        ):
            settings = engine_settings(cfg, client, tokenizer, rewards, chat_gateway)
            groups = EpisodeGroups(build_workflow(cfg.rollout), lambda _: settings, cfg.generation.n_samples, task.name)
            return await groups.run(client, example)

    records = asyncio.run(run())
    assert len(records) == cfg.generation.n_samples  # one record an episode: none branched, none failed
    score = load_object(str(project / "rewards/my_reward.py:score"), "reward.fn")
    _check_records(records, example, workflow, tokenizer, score)
    assert all(r.segments[0].temperature in (None, cfg.generation.temperature) for r in records)


@pytest.mark.parametrize("workflow", WORKFLOWS)
def test_evaluation_is_greedy_on_every_path(project, tiny_model_dir, tokenizer, rewards, workflow):
    """Evaluated as SFT and ``areal-hpc eval`` evaluate (the embedded engine in this process): no episode
    fails, and the same model gives the same episodes twice."""
    cfg = config(project, "my_agent.yaml", f"model.path={tiny_model_dir}", f"rollout.workflow={workflow}")
    task = open_task(cfg, tokenizer, tiny_model_dir)
    model, examples = load_model(tiny_model_dir), task.eval[:2]

    def episodes():
        result = evaluate_model(
            model,
            tokenizer,
            examples,
            rewards,
            Sampling.from_config(cfg.generation),
            build_workflow(cfg.rollout),
            tiny_model_dir,
        )
        assert result.episode_failures == 0, [e.get("error") for e in result.episodes]
        return [(e["completion"], e["turns"]) for e in result.episodes]

    assert episodes() == episodes()


class AsksForTemperature:
    """An agent that sets its own temperature, in the request and again in ``extra_body``."""

    async def arun_episode(self, engine, example):
        client = engine.openai_client()
        for extra in ({}, {"temperature": 0.9}):
            await client.chat.completions.create(
                model=engine.model_name, messages=example.chat_messages(), temperature=0.7, extra_body=extra
            )
        return None


def test_a_chat_client_samples_as_its_episode_and_greedily_in_an_evaluation(tiny_model_dir, tokenizer, server, rewards):
    """Requests that name no sampling take the episode's (max_tokens, temperature); a greedy episode's every
    turn is greedy, whatever its request asks."""

    async def run(sampling: Sampling, workflow):
        async with RolloutClient([server]) as client, ChatGateway(client.generate, tiny_model_dir) as chat:
            settings = EpisodeSettings(client.generate, tokenizer, sampling, Scorer(rewards), chat)
            return await run_episode(workflow, EpisodeContext(settings), Example("q", "What is 2+3?", answer="5"))

    class Plain:
        async def arun_episode(self, engine, example):
            client = engine.openai_client()
            await client.chat.completions.create(model=engine.model_name, messages=example.chat_messages())
            return None

    [plain] = asyncio.run(run(Sampling(3, temperature=0.5), Plain()))
    assert len(plain.segments[0].output_ids) <= 3 and plain.segments[0].temperature == 0.5
    asked = asyncio.run(run(Sampling(3, temperature=0.5), AsksForTemperature()))
    assert [s.temperature for r in asked for s in r.segments] == [0.7, 0.9]
    greedy = asyncio.run(run(Sampling(3, temperature=0.5).greedy(), AsksForTemperature()))
    assert [s.temperature for r in greedy for s in r.segments] == [0.0, 0.0]


def test_the_warm_up_demos_are_the_records_the_agent_makes(project, demos, preset_dir, rewards):
    """A model that says a demo's model turns drives MyAgent through its tool call and answer: the demo's SFT
    sequence, rendered as ``areal-hpc sft`` renders it (with its tools, on the config's Qwen3-template model),
    is token for token, mask for mask, the episode's one record (the agent sends the call back with its
    reasoning, so Qwen3's template writes it as the model did)."""
    folder = preset_dir("qwen3-replica")
    tokenizer = load_tokenizer(folder)
    cfg = config(project, "my_agent_sft.yaml", f"model.path={folder}")
    task = open_task(cfg, tokenizer, folder)
    demo = task.train[0]
    sequences = sft_sequences(tokenizer, demo, check_demonstrations(task.train, folder))
    model = Says([turn for ids, mask in sequences for _, turn in trained_turns(ids, mask)])
    workflow = load_object(str(project / "workflows/my_agent.py:MyAgent"), "rollout.workflow")()

    async def run():
        async with ChatGateway(model, folder) as chat:
            settings = EpisodeSettings(model, tokenizer, Sampling(64), Scorer(rewards), chat)
            example = Example("q", demo.messages[0]["content"], answer=demo.answer)
            return await run_episode(workflow, EpisodeContext(settings), example)

    [record] = asyncio.run(run())
    assert len(record.segments) == 2 and record.reward == 1.0  # called add, read its result, answered right
    assert sequences == [trajectory_sequence(record, 1.0)[:2]]


OWNERS = {
    "example": lambda tokenizer: Example("train.parquet/0", "What is 2+3?", answer="5"),
    "engine": lambda tokenizer: EpisodeContext(EpisodeSettings(None, tokenizer, Sampling(4), None)),
    "ep": lambda tokenizer: TokenEpisode(EpisodeContext(EpisodeSettings(None, tokenizer, Sampling(4), None)), [1]),
    "turn": lambda tokenizer: Generation([1]),
}
SPAN = re.compile(r"`(?:await |\w+ = await )?(example|engine|ep|turn)\.(\w+)(\([^`]*\))?`")


def test_what_a_workflow_receives_is_documented_by_its_real_names(tokenizer):
    """Every ``example.x``, ``engine.x``, ``ep.x`` and ``turn.x`` the agent page names exists, and a call it
    shows passes parameters the method has, positional ones in its order."""
    text = (REPO / "docs/tutorials/agents.md").read_text()
    spans = SPAN.findall(text)
    assert {owner for owner, _, _ in spans} == set(OWNERS) and len(spans) >= 25
    for owner, name, call in spans:
        obj = OWNERS[owner](tokenizer)
        assert hasattr(obj, name), f"`{owner}.{name}` is not an attribute of {type(obj).__name__}"
        if not call:
            continue
        params = list(inspect.signature(getattr(obj, name)).parameters)
        shown = ast.parse(f"f{call}").body[0].value
        positional = [a.id for a in shown.args]
        assert params[: len(positional)] == positional, f"`{owner}.{name}{call}`: its parameters are {params}"
        assert {k.arg for k in shown.keywords} <= set(params), f"`{owner}.{name}{call}`: its parameters are {params}"
