"""A preparation stage forked from the local launcher's fork server (``launch.roles.run_stage``): with
``release`` (the SFT warm-up) the fork server is gone while the stage runs and a new one forks after it;
without (model initialisation) the same fork server stays.

Each case runs a small launcher in its own process (the fork server makes its launcher a subreaper,
which pytest's process should not become).
"""

import json
import subprocess
import sys
import textwrap

import pytest

LAUNCHER = textwrap.dedent("""
    import json, sys
    from areal_hpc.launch.roles import run_stage
    from areal_hpc.runtime.forkserver import Forker
    stage, out, release = sys.argv[1], sys.argv[2], sys.argv[3] == "release"
    server = Forker({}).start()
    first = server.process.pid
    run_stage("stage", [sys.executable, "-c", stage, str(first), out], {}, server, release=release)
    after = server.spawn("after", [sys.executable, "-c", "import sys; sys.exit(3)"], {}, None, None)
    print(json.dumps({"first": first, "now": server.process.pid, "after_code": after.wait(timeout=60)}))
    server.close()
""")

# the stage: whether the fork server that forked it still runs 5 s later (a closed one is reaped at once)
STAGE = textwrap.dedent("""
    import os, sys, time
    server, out = sys.argv[1], sys.argv[2]
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{server}") and time.monotonic() < deadline:
        time.sleep(0.05)
    open(out, "w").write("alive" if os.path.exists(f"/proc/{server}") else "gone")
""")


@pytest.mark.parametrize("release", [True, False])
def test_a_released_fork_server_is_gone_while_the_stage_runs_and_another_forks_after_it(tmp_path, release):
    out = tmp_path / "server_during_stage"
    launcher = subprocess.run(
        [sys.executable, "-c", LAUNCHER, STAGE, str(out), "release" if release else "keep"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert launcher.returncode == 0, launcher.stderr
    result = json.loads(launcher.stdout.splitlines()[-1])
    assert out.read_text() == ("gone" if release else "alive")
    assert (result["now"] != result["first"]) is release
    assert result["after_code"] == 3  # the fork server after the stage starts children
