"""Server supervision (health wait, log tail on failure), the SGLang launch command, the address a
server advertises."""

import asyncio
import socket
import sys
import time

import pytest

from areal_hpc.config import load_config
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.rollout.sglang_server import sglang_command
from areal_hpc.runtime.bootstrap import node_address
from areal_hpc.runtime.name_resolve import free_port
from areal_hpc.runtime.supervisor import ServerLaunchError, SupervisedProcess
from tests.conftest import embedded_server, run_cli


def test_sglang_command_carries_the_config():
    cfg = load_config(
        None,
        [
            "model.path=/models/qwen",
            "model.dtype=bfloat16",
            "rollout.tp_size=2",
            "rollout.dp_size=4",
            "rollout.mem_fraction_static=0.7",
            "rollout.host=0.0.0.0",
            "rollout.max_running_requests=128",
            "experiment.seed=3",
        ],
    )
    command = sglang_command(cfg, 30001, python="python")
    assert command[:3] == ["python", "-m", "sglang.launch_server"]
    pairs = dict(zip(command[3::2], command[4::2]))
    assert pairs["--model-path"] == "/models/qwen" and pairs["--port"] == "30001" and pairs["--host"] == "0.0.0.0"
    assert (pairs["--tp-size"], pairs["--dp-size"], pairs["--dtype"]) == ("2", "4", "bfloat16")
    assert (pairs["--mem-fraction-static"], pairs["--max-running-requests"], pairs["--random-seed"]) == (
        "0.7",
        "128",
        "3",
    )
    assert command[-1] == "--skip-tokenizer-init" and "--context-length" not in command
    with_context = sglang_command(load_config(None, ["model.path=/m", "rollout.context_length=4096"]), 1)
    assert with_context[-2:] == ["--context-length", "4096"]


def test_serve_with_sglang_missing_says_which_extra_to_install(tiny_model_dir):
    result = run_cli("serve", "backend=sglang", f"model.path={tiny_model_dir}")
    assert result.returncode == 2 and "pip install 'areal-hpc[sglang]'" in result.stderr
    assert result.stderr.count("\n") == 1


def test_supervised_server_becomes_healthy_and_serves_the_same_client(tiny_model_dir, tmp_path):
    port = free_port("127.0.0.1")
    command = [
        sys.executable,
        "-m",
        "areal_hpc",
        "serve",
        "backend=embedded",
        f"model.path={tiny_model_dir}",
        f"port={port}",
        f"cluster.fileroot={tmp_path}",
    ]
    server = SupervisedProcess("embedded server", command, tmp_path / "server.log").start()
    try:
        server.wait_healthy(f"127.0.0.1:{port}", timeout_s=120)

        async def ask():
            async with RolloutClient([f"127.0.0.1:{port}"]) as client:
                return await client.generate([1, 2, 3], {"max_new_tokens": 5, "ignore_eos": True})

        assert len(asyncio.run(ask()).output_ids) == 5
    finally:
        server.stop()
    assert server.process.returncode is not None


def test_a_server_that_dies_at_launch_is_reported_with_its_log_tail(tmp_path):
    command = [sys.executable, "-m", "areal_hpc", "serve", "backend=embedded", f"model.path={tmp_path / 'nowhere'}"]
    server = SupervisedProcess("embedded server", command, tmp_path / "server.log").start()
    with pytest.raises(ServerLaunchError) as failure:
        server.wait_healthy("127.0.0.1:9", timeout_s=120)
    message = str(failure.value)
    assert "exited with code 2 before answering /health" in message
    assert "nowhere" in message.splitlines()[-1]  # the cause, from the server's own log


def test_a_server_that_never_answers_is_stopped_after_the_timeout(tmp_path):
    command = [sys.executable, "-c", "import time; print('loading weights', flush=True); time.sleep(600)"]
    server = SupervisedProcess("slow server", command, tmp_path / "server.log").start()
    deadline = time.monotonic() + 60  # its line is in the log before the 2 s start (a loaded machine starts slowly)
    while "loading weights" not in (tmp_path / "server.log").read_text():
        assert server.process.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
        time.sleep(0.05)
    with pytest.raises(ServerLaunchError, match=r"did not answer http://127.0.0.1:9/health within 2 s") as failure:
        server.wait_healthy("127.0.0.1:9", timeout_s=2)
    assert "loading weights" in str(failure.value)
    assert server.process.poll() is not None  # not left running


def test_serve_on_a_taken_port_is_one_line(tiny_model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run_cli(
            "serve", "backend=embedded", f"model.path={tiny_model_dir}", f"port={port}", f"cluster.fileroot={tmp_path}"
        )
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr


def test_a_server_bound_to_every_interface_advertises_the_nodes_address(tiny_model_dir, tmp_path):
    with embedded_server(tiny_model_dir, tmp_path, "rollout.host=0.0.0.0") as (_, address):
        host = address.rsplit(":", 1)[0]
        assert host == node_address() and host != "0.0.0.0"  # what another node can connect to

        async def healthy():
            async with RolloutClient([address]) as client:
                return await client.healthy(address)

        assert asyncio.run(healthy())
