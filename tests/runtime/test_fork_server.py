"""The local launcher's fork server: a child forked from it is the launcher's own child, as ``python
<command>`` would be (session, cores, log, environment, threads, argv, exit code), shares the imported
pages, and dies with the launcher even on SIGKILL.

Each case runs a small launcher in its own process (the fork server makes its launcher a subreaper,
which pytest's process should not become).
"""

import importlib.util
import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areal_hpc.launch.roles import FORK_SERVER_PRELOAD
from areal_hpc.runtime.forkserver import Forker, ForkerError

LAUNCHER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from areal_hpc.launch.roles import FORK_SERVER_PRELOAD
    from areal_hpc.runtime.forkserver import Forker
    from areal_hpc.runtime.supervisor import SupervisedProcess
    out = Path(sys.argv[1])
    os.environ["IN_LAUNCHER"] = "1"
    server = Forker({"ONLY_THE_SERVER": "1"}, FORK_SERVER_PRELOAD).start()
    child = SupervisedProcess("probe", [sys.executable, "-c", sys.argv[2], str(out), "second arg"], out / "probe.log",
                              {"OMP_NUM_THREADS": "2", "ONLY_THE_CHILD": "yes"}, cores=[0],
                              fork_server=server).start()
    print(json.dumps({"pid": child.process.pid}), flush=True)
    if sys.argv[3] == "wait":
        print(json.dumps({"code": child.process.wait(timeout=120), "server_alive": server.process.poll() is None}))
        server.close()
    elif sys.argv[3] == "stop":  # once the child runs its command
        while not (out / "probe.json").exists():
            time.sleep(0.05)
        child.stop(grace_s=5)
        print(json.dumps({"code": child.process.returncode}))
        server.close()
    else:
        time.sleep(600)  # killed by the test
""")

PROBE = textwrap.dedent("""
    import json, os, sys, torch
    from pathlib import Path
    print("to the log")
    Path(sys.argv[1], "probe.json").write_text(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "argv": sys.argv[1:],
        "threads": torch.get_num_threads(), "cores": sorted(os.sched_getaffinity(0)),
        "env": [os.environ.get(name) for name in ("ONLY_THE_CHILD", "IN_LAUNCHER", "ONLY_THE_SERVER")],
        "torch_preloaded": "transformers" in sys.modules,
        "shared_dirty_mb": next(int(line.split()[1]) // 1024 for line in open("/proc/self/smaps_rollup")
                                if line.startswith("Shared_Dirty:"))}))
    sys.exit(int(os.environ.get("PROBE_EXIT", "7")))
""")

SLEEPER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    Path(sys.argv[1], "probe.json").write_text(str(os.getpid()))
    time.sleep(600)
""")


def launch(tmp_path, probe: str, mode: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), probe, mode, *extra], stdout=subprocess.PIPE, text=True
    )


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_forked_child_is_the_launchers_own_with_its_environment_cores_log_argv_and_exit_code(tmp_path):
    launcher = launch(tmp_path, PROBE, "wait")
    out, _ = launcher.communicate(timeout=180)
    started, ended = (json.loads(line) for line in out.splitlines())
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["pid"] == started["pid"] == probe["pgid"]  # its own session, as start_new_session gives
    assert probe["ppid"] == launcher.pid  # adopted: the launcher waits for it and reads its exit code
    assert ended == {"code": 7, "server_alive": True}
    assert probe["argv"] == [str(tmp_path), "second arg"]
    assert probe["threads"] == 2 and probe["cores"] == [0]
    assert probe["env"] == ["yes", "1", None]  # as Popen gives it: the launcher's and its own, not the server's
    assert probe["torch_preloaded"]  # it ran in the fork server's interpreter, not a fresh one
    assert probe["shared_dirty_mb"] > 100  # what the fork server imported, shared instead of copied
    assert "to the log" in (tmp_path / "probe.log").read_text()


def test_stopping_a_forked_child_signals_its_group_and_reaps_it(tmp_path):
    launcher = launch(tmp_path, SLEEPER, "stop")
    out, _ = launcher.communicate(timeout=180)
    started, ended = (json.loads(line) for line in out.splitlines())
    assert ended == {"code": -signal.SIGTERM}
    assert not alive(started["pid"])


def test_a_forked_child_dies_with_its_launcher_even_on_sigkill(tmp_path):
    launcher = launch(tmp_path, SLEEPER, "hold")
    try:
        pid = json.loads(launcher.stdout.readline())["pid"]
        deadline = time.monotonic() + 120
        while not (tmp_path / "probe.json").exists():
            assert launcher.poll() is None, f"the launcher exited ({launcher.returncode}) before its child ran"
            assert time.monotonic() < deadline, f"the child never ran (alive: {alive(pid)})"
            time.sleep(0.1)
        assert alive(pid)
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 60  # it dies at once; the bound is for a loaded machine
    while alive(pid):
        assert time.monotonic() < deadline, f"the forked child outlived its launcher by 60 s (pid {pid})"
        time.sleep(0.1)


def test_the_launcher_preloads_modules_that_exist():
    """The launcher names them as strings (importing them would import torch in the launcher)."""
    assert all(importlib.util.find_spec(module) for module in FORK_SERVER_PRELOAD)


def test_only_module_and_code_commands_are_forked():
    with pytest.raises(ForkerError, match="runs 'python -m' and 'python -c' commands"):
        Forker({}).spawn("a script", [sys.executable, "x.py"], {}, None, None)
