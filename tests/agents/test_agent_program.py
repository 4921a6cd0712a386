"""An agent program of the user's, trained as it is (``rollout.workflow=agent_program``): the Agents SDK example
(configs/agent_program.py) runs in a process of its own, its tool call goes through the run's chat routes over
HTTP and lands in the record with the tool's output masked; a program gets its example on stdin and the run's
API in its environment, sampled as the run samples; its failures (an exit status, a traceback, a timeout, output
that is not text, no request) are counted as ``agent_program`` with one line; a cancelled episode ends what it
started; a command that does not exist is one line and exit 2. On the dev Slurm cluster, the example trains
inside one job and a ``scontrol requeue`` mid-run loses no finished episode and trains none twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_hpc.agents.chat import ChatGateway
from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, Sampling, Scorer
from areal_hpc.agents.groups import EpisodeGroups, run_episode
from areal_hpc.agents.registry import build_workflow
from areal_hpc.config import RolloutConfig
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.shards.reader import TrajectoryStore
from areal_hpc.data.tasks import Example
from areal_hpc.errors import UserError
from areal_hpc.models.hf import load_tokenizer
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.rollout.controller import FailureBudget, RolloutController, RolloutFailure
from areal_hpc.rollout.staleness import StalenessGate
from tests import rewards_for_tests
from tests.conftest import REPO, run_cli
from tests.launch.test_slurm_launch import PROFILE, wait_for_step
from tests.proxy.test_parts import TOOL_TEMPLATE
from tests.run_audit import OWN, assert_each_trajectory_trained_once, read_audit, untrained_at
from tests.slurm_jobs import cancel, submitted_job, wait_for, wait_for_end
from tests.workflow_helpers import ScriptedModel, memorise

CONFIG = REPO / "configs" / "agent_program.yaml"
EXAMPLE = f"{sys.executable} {REPO / 'configs' / 'agent_program.py'}"
QUESTION = Example("q", "What is 2+3?", answer="5", fields={"unit": "cm"})
TOOL_CALL = '<tool_call>{"name":"calculate","arguments":{"a":2,"op":"+","b":3}}</tool_call>'


def workflow(**args):
    """The built-in, as a run builds it from ``rollout.workflow_args``."""
    return build_workflow(RolloutConfig(workflow="agent_program", workflow_args=args))


async def episode(generate, model_dir, program: str, sampling: Sampling | None = None, **args):
    """One episode of ``program`` (a command) on ``QUESTION`` over ``generate``, scored by exact match."""
    sampling = sampling or Sampling(8)
    with RewardPool(rewards_for_tests.exact_answer, workers=0) as pool:
        async with ChatGateway(generate, model_dir) as chat:
            settings = EpisodeSettings(generate, load_tokenizer(model_dir), sampling, Scorer(pool), chat)
            return await run_episode(workflow(command=program, **args), EpisodeContext(settings), QUESTION)


@pytest.fixture(scope="module")
def tool_template_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model's tokenizer with a chat template that offers tools (Qwen's ``<tool_call>`` blocks)."""
    import shutil

    folder = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def example_episode(tool_template_dir):
    """The example program's episode with a model that calls its calculator and answers from the result:
    (its record, the two prompts the model was given)."""
    model = ScriptedModel(load_tokenizer(tool_template_dir), [TOOL_CALL, "5"])
    [record] = asyncio.run(episode(model, tool_template_dir, EXAMPLE, sampling=Sampling(64)))
    return record, model.seen


def test_the_example_programs_tool_call_goes_through_the_run_and_its_output_is_masked(
    example_episode, tool_template_dir
):
    record, _ = example_episode
    tokenizer = load_tokenizer(tool_template_dir)
    call, answer = record.segments
    prompt = tokenizer.decode(call.input_ids, skip_special_tokens=False)
    assert '"name": "calculate"' in prompt and "Use the calculator tool" in prompt and "What is 2+3?" in prompt
    assert tokenizer.decode(call.output_ids, skip_special_tokens=True) == TOOL_CALL
    assert "<|im_start|>tool\n5.0<|im_end|>" in tokenizer.decode(answer.input_ids, skip_special_tokens=False)
    assert tokenizer.decode(answer.output_ids, skip_special_tokens=True) == "5"  # the program printed it: scored
    assert record.reward == 1.0 and record.metadata["example"] == "q"


PROBE = """
import json, os, sys, urllib.request
task = json.load(sys.stdin)
body = {"model": os.environ["OPENAI_MODEL"], "messages": task["messages"], "temperature": 0.9}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
                                 {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
reply = json.load(urllib.request.urlopen(request))
if len(sys.argv) > 2:  # rewards its turn itself, as agents on the login-node proxy do
    rewarded = urllib.request.Request(os.environ["OPENAI_BASE_URL"][: -len("/v1")] + "/rl/set_reward",
                                      json.dumps({"reward": float(sys.argv[2])}).encode(),
                                      {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    urllib.request.urlopen(rewarded)
names = ["OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL", "OPENAI_AGENTS_DISABLE_TRACING"]
seen = {"env": {name: os.environ[name] for name in names}, "task": task, "python": sys.executable}
open(sys.argv[1], "w").write(json.dumps(seen))
print(reply["choices"][0]["message"]["content"])
"""


def test_a_program_gets_its_example_on_stdin_and_the_runs_api_sampled_as_the_run_samples(tiny_model_dir, tmp_path):
    """``python`` is the run's interpreter; a request's own temperature gives way to an evaluation's greedy
    decoding, and one that gives no max_tokens gets the run's. What it prints is scored, unless it rewarded
    its turn itself through the proxy's /rl/set_reward."""
    (tmp_path / "probe.py").write_text(PROBE)
    model, asked = ScriptedModel(load_tokenizer(tiny_model_dir), ["5", "5"]), []

    async def generate(input_ids, params):
        asked.append(params)
        return await model(input_ids, params)

    def run(*args: str):
        [record] = asyncio.run(
            episode(
                generate,
                tiny_model_dir,
                shlex.join(["python", str(tmp_path / "probe.py"), *args]),
                Sampling(5).greedy(),
            )
        )
        return record

    scored, rewarded = run(str(tmp_path / "seen.json")), run(str(tmp_path / "again.json"), "0.25")
    seen = json.loads((tmp_path / "seen.json").read_text())
    env = seen["env"]
    assert env["OPENAI_BASE_URL"].startswith("http://127.0.0.1:") and env["OPENAI_BASE_URL"].endswith("/v1")
    assert env["OPENAI_API_KEY"].startswith("sk") and env["OPENAI_MODEL"] == Path(tiny_model_dir).name
    assert env["OPENAI_AGENTS_DISABLE_TRACING"] == "1" and Path(seen["python"]).parent == Path(sys.executable).parent
    assert seen["task"] == {
        "id": "q",
        "messages": [{"role": "user", "content": QUESTION.prompt}],
        "fields": {"unit": "cm"},
    }
    assert [(p["max_new_tokens"], p["temperature"]) for p in asked] == [(5, 0.0), (5, 0.0)]
    assert scored.reward == 1.0 and len(scored.segments) == 1  # its one turn, scored by what it printed
    assert rewarded.reward == 0.25 and json.loads((tmp_path / "again.json").read_text())["env"] != env  # own key


PROGRAMS = {
    "raises": (
        "def main():\n    return 1 / 0\n\n\nmain()\n",
        "exited with 1: ZeroDivisionError: division by zero ({}:2)",
    ),
    "killed": ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n", "was killed by SIGTERM"),
    "hangs": ("import time\ntime.sleep(60)\n", "ran past 0.5 s (rollout.workflow_args.timeout_s)"),
    "not text": (
        "import sys\nsys.stdout.buffer.write(bytes([255]))\n",
        "printed what is not UTF-8 text (invalid start byte)",
    ),
    "no request": ("print(5)\n", "ended without asking the model (at OPENAI_BASE_URL, with OPENAI_API_KEY)"),
}


@contextlib.asynccontextmanager
async def program_controller(model_dir, command: str, stopping: asyncio.Event | None = None):
    """A started controller whose episodes run ``command`` (timeout 0.5 s) on ``QUESTION``; one failure
    spends its budget."""
    tokenizer = load_tokenizer(model_dir)
    async with RolloutClient(["127.0.0.1:9"]) as client:  # never contacted: the program asks nothing
        with RewardPool(rewards_for_tests.exact_answer, workers=0) as pool:
            async with ChatGateway(client.generate, model_dir) as chat:
                settings = EpisodeSettings(client.generate, tokenizer, Sampling(4), Scorer(pool), chat)
                groups = EpisodeGroups(workflow(command=command, timeout_s=0.5), lambda _: settings, 1, "sums")
                controller = RolloutController(
                    client,
                    groups,
                    StalenessGate(1, 0, 1),
                    [QUESTION],
                    budget=FailureBudget(max_consecutive=1),
                    stopping=stopping,
                )
                await controller.start()
                try:
                    yield controller
                finally:
                    await controller.stop()


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_a_failing_program_is_counted_as_agent_program_with_one_line(tiny_model_dir, tmp_path, program):
    code, words = PROGRAMS[program]
    path = tmp_path / "agent.py"
    path.write_text(code)

    async def run():
        async with program_controller(tiny_model_dir, f"python {path}") as controller:
            with pytest.raises(RolloutFailure) as failed:
                await asyncio.wait_for(controller.prepare_batch(1), 60)
            return failed.value, controller.failures

    error, failures = asyncio.run(run())
    line = f"q: python {path} {words.format(path)}"
    assert failures.counts == {"agent_program": 1} and failures.first["agent_program"] == line
    assert "1 episodes in a row failed (agent_program 1)" in str(error) and str(error).endswith(line)


def test_programs_a_stop_signal_ended_are_not_failures(tiny_model_dir, tmp_path):
    """Slurm signals the job's processes at once: a program killed by SIGTERM while the run's own stop signal
    is on its way (seen up to a second later, while the trainer is busy) is the stop's doing, neither counted
    nor charged; so is every failure after the signal. Episodes go on being tried until the run stops."""
    (tmp_path / "agent.py").write_text(PROGRAMS["killed"][0])

    async def run():
        stopping = asyncio.Event()
        async with program_controller(tiny_model_dir, f"python {tmp_path / 'agent.py'}", stopping) as controller:
            asyncio.get_running_loop().call_later(1.0, stopping.set)
            while controller.started < 3 and controller.submitting:  # two ended by the signal, the third running
                await asyncio.sleep(0.05)
            return controller.failures.total, controller.budget.spent(), controller.submitting

    assert asyncio.run(run()) == (0, None, True)


def test_a_cancelled_episode_ends_its_program_and_what_the_program_started(tiny_model_dir, tmp_path):
    (tmp_path / "agent.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        "open(sys.argv[1], 'w').write(f'{child.pid}')\n"
        "time.sleep(60)\n"
    )
    pid_file = tmp_path / "child.pid"

    async def run():
        started = asyncio.ensure_future(
            episode(ScriptedModel(None, []), tiny_model_dir, f"python {tmp_path / 'agent.py'} {pid_file}")
        )
        while not pid_file.exists() or not pid_file.read_text():
            await asyncio.sleep(0.05)
        started.cancel()
        with pytest.raises(asyncio.CancelledError):
            await started
        return int(pid_file.read_text())

    child = asyncio.run(run())
    stat = Path(f"/proc/{child}/stat")

    def ended() -> bool:  # gone, or a zombie of the killed program
        with contextlib.suppress(FileNotFoundError):
            return stat.read_text().split(") ")[1][0] == "Z"
        return True

    # the kill reaches the child's process group at once; the child takes it when next scheduled
    deadline = time.monotonic() + 10
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended(), stat.read_text()


@pytest.mark.parametrize(
    "args, words",
    [
        ({"command": ""}, ["'rollout.workflow_args.command' is empty"]),
        ({"command": "python agent.py", "timeout_s": 0}, ["'rollout.workflow_args.timeout_s': 0"]),
    ],
)
def test_a_bad_command_or_timeout_is_one_line(args, words):
    with pytest.raises(UserError) as err:
        workflow(**args)
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value)


def test_a_command_that_does_not_exist_is_one_line_and_exit_2(tmp_path):
    result = run_cli(
        "train",
        "--config",
        str(CONFIG),
        f"cluster.fileroot={tmp_path}",
        "rollout.workflow_args.command=no-such-agent --flag",
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "'rollout.workflow_args.command': 'no-such-agent' is neither a program on PATH" in line, line


@pytest.fixture(scope="module")
def tool_calling_model(example_episode, tool_template_dir, tmp_path_factory) -> Path:
    """A small model (two layers of 64) with the tool template that says, greedily, the example program's
    calculator call to "What is 2+3?" and then "5" from the tool's result: taught here from the prompts the
    program really sends (a stand-in for a tool-calling model)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_hpc.models.hf import save_model

    _, (first_prompt, second_prompt) = example_episode
    tokenizer = load_tokenizer(tool_template_dir)
    base = json.loads((tool_template_dir / "config.json").read_text())
    config = Qwen2Config(
        vocab_size=base["vocab_size"],
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=base["max_position_embeddings"],
        tie_word_embeddings=True,
        **{k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in base},
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    memorise(model, tokenizer, [(first_prompt, TOOL_CALL), (second_prompt, "5")], confidence=0.9)
    return save_model(model, tokenizer, tmp_path_factory.mktemp("tool_calling") / "model")


@pytest.mark.slurm
@pytest.mark.slow
def test_an_agent_program_trains_in_one_slurm_job_and_a_requeue_loses_no_episode_and_trains_none_twice(
    tool_calling_model, tmp_path
):
    """A user's project submitted from its folder with relative paths: their copy of the example program, run
    by its command in the job's folder (the one it was submitted from), their data and reward. The run's
    episodes are the program's, each record its two turns with the tool call. Requeued while a finished
    episode waits for the second of its batch: none is trained twice, none lost, none counted as failed (the
    programs Slurm's signal ended were the run's to stop), and those the checkpoint had not trained are
    trained first after the resume."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "agent.py").write_text((REPO / "configs" / "agent_program.py").read_text())
    (project / "reward.py").write_text(
        "def score(prompt, completion, prompt_ids, completion_ids, answer, **fields):\n"
        "    return float(completion.strip() == answer)\n"
    )
    (project / "sums.jsonl").write_text(
        "".join(json.dumps({"prompt": "What is 2+3?", "answer": "5"}) + "\n" for _ in range(16))
    )
    total = 3
    result = run_cli(
        "submit",
        "--profile",
        PROFILE,
        "--config",
        str(CONFIG),
        f"model.path={tool_calling_model}",
        f"cluster.fileroot={tmp_path / 'runs'}",
        "rollout.workflow_args.command=python project/agent.py",
        "dataset.task=custom",
        "dataset.path=project/sums.jsonl",
        "dataset.eval_size=1",
        "reward.fn=project/reward.py:score",
        f"rl.total_train_steps={total}",
        "rl.eval_every_steps=0",
        "rl.sft_warmup_steps=0",
        "saver.freq_steps=1000",
        "generation.greedy=true",  # the taught model says its call exactly
        "generation.n_samples=1",
        "generation.max_new_tokens=64",
        "rollout.consumer_batch_size=2",
        "rollout.max_concurrent_rollouts=3",  # three finish together: the third waits for the fourth
        "stats.tensorboard=false",
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    job = submitted_job(result.stdout)
    run = tmp_path / "runs" / "agent_program" / "trial0"
    try:
        wait_for_step(run, 1, job)
        wait_for(lambda: stored(run) - set(read_audit(run).trained), 120, "a finished episode not trained yet")
        requeued = time.time()
        subprocess.run(["scontrol", "requeue", job], check=True)  # SIGTERM to every task, then requeue
        ended = wait_for_end(job, 300, components=2)
    finally:
        cancel(job)
    assert {state for state, _, _ in ended.values()} == {"COMPLETED"}, ended
    audit = assert_each_trajectory_trained_once(run, total)  # each stored episode trained once, dropped or pending
    [resumed] = audit.resumed_from
    with TrajectoryStore(run / "shards") as store:
        records = {r.id: r for r in store.trajectories(OWN)}
    recovered = {i for i in untrained_at(run, resumed) if records[i].created < requeued}
    after = [i for step in range(resumed + 1, total + 1) for i in audit.effective[step]]
    assert 1 <= resumed < total and set(after[: len(recovered)]) <= recovered  # oldest first
    failures = run / "logs" / "failures.log"
    assert not failures.exists(), failures.read_text()
    tokenizer = load_tokenizer(tool_calling_model)
    trained = [records[i] for i in audit.trained]
    assert trained and all(len(r.segments) == 2 and r.reward == 1.0 for r in trained)
    assert all(tokenizer.decode(r.segments[0].output_ids, skip_special_tokens=True) == TOOL_CALL for r in trained)


def stored(run: Path) -> set[str]:
    """The ids of the run's stored episodes (the shards read while the run writes them)."""
    with TrajectoryStore(run / "shards") as store:
        return {t.id for t in store.trajectories(OWN)}
