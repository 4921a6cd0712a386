"""The SGLang backend: the ``python -m sglang.launch_server`` command built from our config, run
under the supervisor (health wait, log tail on failure) and registered in name-resolve once healthy
(its heartbeat kept by this process, which waits on SGLang's).

    areal-hpc serve backend=sglang model.path=/models/Qwen2.5-7B rollout.tp_size=2 port=30000

The controller and the weight sync talk to it exactly as to the embedded engine (same routes), and
its logprobs mean the same: the sampled token's under the tempered distribution before top-p/top-k,
at temperature 1 for greedy requests, as long as SGLANG_RETURN_ORIGINAL_LOGPROB is not set (with it,
SGLang reports temperature-1 logprobs for every request and the trainer's would not match). With
``rl.weight_sync=distributed`` its TP ranks join the trainer's update group as SGLang's model runner
does (train/weight_push.py, parallel/weight_group.py); SGLang requires dp_size 1 for that. SGLang
cannot bind port 0, so it is given a free port (a race another process may win: set port= then).
"""

from __future__ import annotations

import signal
import sys

from areal_hpc.extras import require
from areal_hpc.runtime.name_resolve import advertised_address, free_port, registered_server
from areal_hpc.runtime.rollout_token import server_token
from areal_hpc.runtime.supervisor import SupervisedProcess


def sglang_command(cfg, port: int, python: str = sys.executable, token: str | None = None) -> list[str]:
    """The launch command for one server of ``cfg.rollout`` on ``port``; ``token``: the run's rollout token,
    which SGLang then requires on every route but /health (``--api-key``; SGLang takes it only as an
    argument, so users of the node can read it in ``ps``)."""
    rollout = cfg.rollout
    command = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(cfg.model.path),
        "--host",
        rollout.host,
        "--port",
        str(port),
        "--tp-size",
        str(rollout.tp_size),
        "--dp-size",
        str(rollout.dp_size),
        "--dtype",
        cfg.model.dtype,
        "--mem-fraction-static",
        str(rollout.mem_fraction_static),
        "--max-running-requests",
        str(rollout.max_running_requests),
        "--random-seed",
        str(cfg.experiment.seed),
        "--skip-tokenizer-init",
    ]  # the controller sends token ids and reads token ids back
    if rollout.context_length:
        command += ["--context-length", str(rollout.context_length)]
    if token:
        command += ["--api-key", token]
    return command


def serve_sglang(cfg) -> None:
    """Run one SGLang server in the foreground until it exits or we are stopped."""
    require("sglang")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops SGLang's process group
    port = cfg.rollout.port or free_port(cfg.rollout.host)
    address = advertised_address(cfg.rollout.host, port, cfg.cluster.interface)
    command = sglang_command(cfg, port, token=server_token(cfg.run_dir, cfg.rollout.host))
    server = SupervisedProcess(
        f"SGLang server {address}", command, cfg.run_dir / "logs" / f"sglang-{address.replace(':', '-')}.log"
    ).start()
    try:
        server.wait_healthy(address, cfg.rollout.launch_timeout_s)
        with registered_server(cfg.run_dir, address):
            print(
                f"SGLang rollout server for {cfg.model.path} on http://{address} (log: {server.log_path})", flush=True
            )
            if server.process.wait() != 0:
                raise server.failure(f"exited with code {server.process.returncode}")
    finally:
        server.stop()
