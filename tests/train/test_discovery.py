"""Servers that join a running trainer: one that registers late is used, with the weights pushed before it
came; one that restarts (at a port of its own) gets the current weights before it gets a request.
Real ``areal-hpc serve`` processes in one run folder, found through name-resolve as the driver finds them."""

import asyncio
import contextlib
import subprocess
import sys

from areal_hpc.config import load_config
from areal_hpc.models.chat import prompt_ids
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.train.build import wait_for_servers
from areal_hpc.train.weight_push import DiskWeightSync, DistributedWeightSync, admit_servers
from tests.conftest import REPO
from tests.train.test_trainer import SAMPLING, assert_served_by, perturbed_engine
from tests.waiting import wait_until

JOIN_TIMEOUT_S = 120  # a server process loads torch and the model first


@contextlib.contextmanager
def run_servers(model_dir, cfg):
    """``start()`` launches one more embedded server of the run ``cfg``; all are killed at the end."""
    started = []

    def start() -> subprocess.Popen:
        log = open(cfg.run_dir / f"server{len(started)}.log", "w")  # noqa: SIM115 - the server writes it for its lifetime
        started.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "areal_hpc",
                    "serve",
                    "backend=embedded",
                    f"model.path={model_dir}",
                    "port=0",
                    f"cluster.fileroot={cfg.cluster.fileroot}",
                    f"experiment.trial={cfg.experiment.trial}",
                ],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        log.close()
        return started[-1]

    try:
        yield start
    finally:
        for server in started:
            server.kill()
            server.wait()


def run_config(tmp_path):
    cfg = load_config(None, [f"cluster.fileroot={tmp_path}", "experiment.trial=discovery"])
    cfg.run_dir.mkdir(parents=True)
    return cfg


def joined(reports: list[str], how: str) -> str | None:
    """The address of the server a report line says joined ``how``."""
    return next((line.split()[2] for line in reports if line.endswith(how)), None)


def test_a_server_that_registers_late_is_used_with_the_weights_pushed_before(tiny_model_dir, tmp_path):
    cfg, engine = run_config(tmp_path), perturbed_engine(tiny_model_dir)
    prompt = prompt_ids(engine.tokenizer, "What is 3 + 4?")

    async def run(start):
        start()
        first, directory = await wait_for_servers(cfg, JOIN_TIMEOUT_S)
        async with RolloutClient(first) as client:
            sync, reports = DiskWeightSync(cfg.run_dir / "weights"), []
            await sync.push(engine, client, version=3)
            watching = asyncio.create_task(admit_servers(directory, client, sync, reports.append))
            start()  # the late one
            late = await wait_until(
                lambda: joined(reports, "joined with the weights of version 3"),
                timeout=JOIN_TIMEOUT_S,
                what="the late server to join",
            )
            assert client.alive == first + [late]
            client.drop(first[0], "so that the late one answers")
            generation = await client.generate(prompt, SAMPLING)
            watching.cancel()
            return late, generation

    with run_servers(tiny_model_dir, cfg) as start:
        late, generation = asyncio.run(run(start))
    assert generation.server == late
    assert_served_by(engine, generation, 3)


def test_a_restarted_server_gets_the_current_weights_before_it_serves(tiny_model_dir, tmp_path):
    cfg = run_config(tmp_path)
    before, after = perturbed_engine(tiny_model_dir, seed=1), perturbed_engine(tiny_model_dir, seed=2)
    prompt = prompt_ids(before.tokenizer, "What is 3 + 4?")

    async def run(start):
        crashing = start()
        first, directory = await wait_for_servers(cfg, JOIN_TIMEOUT_S)
        async with RolloutClient(first) as client:
            sync, reports = DistributedWeightSync("gloo", 1 << 16), []
            await sync.connect(client)
            await sync.push(before, client, version=1)
            watching = asyncio.create_task(admit_servers(directory, client, sync, reports.append))
            crashing.kill()  # its entry stays behind, fresh for a while yet
            crashing.wait()
            start()  # the restart, at a port of its own
            restarted = await wait_until(
                lambda: joined(reports, "joins with the next weight push"),
                timeout=JOIN_TIMEOUT_S,
                what="the restarted server to register",
            )
            assert client.alive == first  # no request reaches it before it has the weights
            await sync.push(after, client, version=2)
            assert client.alive == sync.members == [restarted] != first
            generation = await client.generate(prompt, SAMPLING)
            watching.cancel()
            sync.destroy_group()
            return generation

    with run_servers(tiny_model_dir, cfg) as start:
        generation = asyncio.run(run(start))
    assert_served_by(after, generation, 2)
