"""The sandbox against hostile programs (real processes, no mocks): each limit stops what it should and
says so, nothing the program started survives the call, its directory is removed, and the code reward
scores correct, wrong and looping solutions."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from areal_hpc.reward import sandbox
from areal_hpc.reward.code_tests import code_reward
from areal_hpc.reward.sandbox import OUTPUT_LIMIT, run_python
from tests.conftest import REPO


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line or working directory contains ``marker`` (zombies have neither)."""
    found = []
    for name in os.listdir("/proc"):
        if (
            name.isdigit()
            and int(name) != os.getpid()
            and (marker in _read(f"/proc/{name}/cmdline") or marker in _cwd(name))
        ):
            found.append(int(name))
    return found


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # gone
        return ""


def _cwd(pid: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:  # gone, or a zombie
        return ""


def test_a_correct_program_reads_stdin_and_passes():
    result = run_python("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2 3\n")
    assert (result.returncode, result.stdout, result.killed_by, result.timed_out) == (0, "6\n", None, False)


def test_large_stdin_is_fed_and_a_program_that_ignores_it_does_not_hang():
    assert run_python("import sys\nprint(len(sys.stdin.read()))", stdin="x" * 3_000_000).stdout == "3000000\n"
    assert run_python("print('done')", stdin="x" * 3_000_000).stdout == "done\n"


def test_an_infinite_loop_is_stopped_by_the_cpu_limit():
    result = run_python("while True:\n    pass", cpu_s=1, timeout_s=20)
    assert (result.killed_by, result.timed_out, result.returncode) == ("cpu", False, -9)
    assert result.duration_s < 10


@pytest.mark.parametrize("cpu_share, killed_by", [(1.02, "cpu"), (0.9, "cpu"), (0.2, None)])
def test_a_sigkill_the_sandbox_did_not_send_is_the_cpu_limit_once_most_of_it_was_used(cpu_share, killed_by):
    """The launcher's report of a program SIGKILLed at 2 CPU seconds: the kernel's tick-sampled CPU clock may
    run ahead of what wait4 reports, so a little under the limit is still the limit; far under is not."""
    status = ["1", f"{signal.SIGKILL} {2 * cpu_share}"]  # the wait status of a SIGKILL is the signal number
    result = sandbox._result(status, 0, bytearray(), bytearray(), None, cpu_limit=2, duration_s=1.0)
    assert (result.returncode, result.killed_by) == (-signal.SIGKILL, killed_by)


def test_a_sleeping_program_is_stopped_by_the_wall_clock():
    result = run_python("import time\ntime.sleep(1000)", timeout_s=0.5)
    assert (result.killed_by, result.timed_out, result.returncode) == ("wall_clock", True, -9)
    assert result.duration_s < 5


@pytest.mark.parametrize("code", ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(' ' * 10**6)"])
def test_a_memory_bomb_fails_with_memory_error(code):
    result = run_python(code, memory_mb=256)
    assert (result.killed_by, result.returncode) == ("memory", 1)
    assert result.stderr.strip().endswith("MemoryError")


def test_a_file_size_bomb_is_stopped_at_the_file_size_limit():
    result = run_python("with open('big', 'wb') as f:\n    f.write(b'x' * 100 * 2**20)", file_size_mb=1)
    assert result.killed_by == "file_size" and "File too large" in result.stderr


def test_a_fork_bomb_is_stopped_and_nothing_survives():
    marker = uuid.uuid4().hex
    bomb = (
        "import os\nprint(os.getcwd(), flush=True)\nfor _ in range(10):\n    os.fork()\n"
        f"import time\ntime.sleep(1000)  # {marker}"
    )
    result = run_python(bomb, max_processes=1, timeout_s=10)
    # The kernel refuses the first fork (seccomp; RLIMIT_NPROC too for a user): the program raises, unkilled.
    # A watchdog alone let this bomb's 100-fork variant exhaust the machine's PIDs under two test workers.
    assert result.killed_by == "processes" and result.duration_s < 5
    assert result.returncode == 1 and "BlockingIOError: [Errno 11]" in result.stderr
    assert processes_with(result.stdout.strip()) == []


@pytest.mark.parametrize(
    "program",
    ["import subprocess\nsubprocess.run(['true'])", "import threading\nthreading.Thread(target=print).start()"],
    ids=["subprocess", "thread"],
)
def test_no_process_or_thread_starts_under_the_default_limit(program):
    result = run_python(program)
    assert (result.returncode, result.killed_by) == (1, "processes"), result.stderr


def test_forked_children_that_outlive_the_program_are_killed():
    program = """
import os, time
r, w = os.pipe()
for _ in range(5):
    if os.fork() == 0:
        os.write(w, os.readlink('/proc/self').encode() + b'\\n')  # its pid outside any PID namespace
        time.sleep(1000)
with os.fdopen(r) as children:
    print(''.join(children.readline() for _ in range(5)), end='')
"""
    result = run_python(program, max_processes=10)
    assert result.returncode == 0 and result.killed_by is None
    pids = [int(line) for line in result.stdout.split()]
    assert len(pids) == 5
    assert [pid for pid in pids if _read(f"/proc/{pid}/cmdline")] == []  # gone, or a zombie at most


def test_a_grandchild_left_sleeping_is_killed():
    token = f"1000.{uuid.uuid4().int % 10**9}"
    result = run_python(f"import subprocess\nsubprocess.Popen(['sleep', '{token}'])\nprint('left')", max_processes=3)
    assert result.stdout == "left\n" and result.returncode == 0
    assert processes_with(token) == []


def test_a_process_that_left_the_session_is_killed_too():
    token = f"1000.{uuid.uuid4().int % 10**9}"
    # the program ends once the grandchild runs sleep: the pipe's write end (close-on-exec) closes in
    # it at the exec, and in the child at its exit, so the read returns then
    program = f"""
import os
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv('/bin/sleep', ['sleep', '{token}'])
    os._exit(0)
os.close(w)
os.read(r, 1)
"""
    result = run_python(program, max_processes=5)
    assert result.returncode == 0
    assert processes_with(token) == []


def test_nothing_survives_the_caller_being_killed():
    token = f"1000.{uuid.uuid4().int % 10**9}"  # on the sandboxed program's command line: it runs sleep
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "from areal_hpc.reward.sandbox import run_python\n"
                f"run_python(\"import os\\nos.execv('/bin/sleep', ['sleep', '{token}'])\", timeout_s=100)"
            ),
        ],
        cwd=REPO,
    )

    def program() -> list[int]:  # the caller's own command line holds the token too
        return [pid for pid in processes_with(token) if pid != caller.pid]

    try:
        deadline = time.monotonic() + 60
        while not program():
            assert caller.poll() is None, f"the caller exited ({caller.returncode}) before the program ran"
            assert time.monotonic() < deadline, "the sandboxed program never started"
            time.sleep(0.05)
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 60
        while survivors := program():
            assert time.monotonic() < deadline, (
                f"still alive 60 s after the caller's death: {[_read(f'/proc/{pid}/cmdline') for pid in survivors]}"
            )
            time.sleep(0.05)
    finally:
        caller.kill()
        for pid in program():
            os.kill(pid, signal.SIGKILL)


NOBODY_CHECK = """
import json, os, sandbox
fork = sandbox.run_python("import os\\nos.fork()")
escape = sandbox.run_python(
    "import os\\nr, w = os.pipe()\\nif os.fork() == 0:\\n    os.setsid()\\n    if os.fork() == 0:\\n"
    "        os.execv('/bin/sleep', ['sleep', '%s'])\\n    os._exit(0)\\nos.close(w)\\nos.read(r, 1)",
    max_processes=5)
print(json.dumps([os.geteuid(), fork.killed_by, fork.returncode, escape.returncode, escape.network_isolated]))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not os.access("/usr/bin/python3", os.X_OK),
    reason="needs root (to become nobody), setpriv and a system /usr/bin/python3",
)
def test_as_an_unprivileged_user():
    """RLIMIT_NPROC refuses a fork, and without namespaces the launcher still kills a setsid() escapee.
    The sandbox is stdlib only: the system Python runs a copy of it as nobody (this venv may be unreadable)."""
    if subprocess.run(["/usr/bin/python3", "-c", "import sys; assert sys.version_info >= (3, 11)"]).returncode:
        pytest.skip("the system python3 is older than 3.11")
    folder = Path(tempfile.mkdtemp())  # pytest's tmp_path sits below a folder only root can enter
    try:
        folder.chmod(0o755)
        shutil.copy(sandbox.__file__, folder / "sandbox.py")
        token = f"1000.{uuid.uuid4().int % 10**9}"
        (folder / "check.py").write_text(NOBODY_CHECK % token)
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "check.py"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        shutil.rmtree(folder)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [65534, "processes", 1, 0, False]
    assert processes_with(token) == []


def test_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        result = run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        )
        if not result.network_isolated:
            assert result.returncode == 0 and result.stdout == "connected\n"
            pytest.skip("no network namespace here (it needs root or CAP_SYS_ADMIN): the program could connect")
        assert result.returncode == 1 and "connected" not in result.stdout
        assert "OSError" in result.stderr or "Error" in result.stderr
        with pytest.raises(BlockingIOError):
            server.accept()


def test_the_directory_is_removed_whatever_the_program_did_to_it(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o500)
    program = f"""
import os
print(os.getcwd())
os.makedirs('locked/inner')
open('locked/inner/f', 'w').write('x')
os.symlink({str(outside)!r}, 'link')
os.chmod('locked/inner', 0)
os.chmod('locked', 0)
os.chmod('.', 0o500)
"""
    result = run_python(program)
    workdir = result.stdout.split()[0]
    assert result.returncode == 0 and workdir.startswith("/")
    assert not os.path.exists(workdir)
    assert outside.stat().st_mode & 0o777 == 0o500  # the link was not followed


@pytest.mark.slow
def test_a_directory_tree_too_deep_for_a_recursive_walk_is_removed():
    program = "import os\nprint(os.getcwd())\nfor _ in range(1100):\n    os.mkdir('d')\n    os.chdir('d')"
    result = run_python(program)
    assert result.returncode == 0 and not os.path.exists(result.stdout.strip())


def test_the_directory_is_removed_after_a_kill():
    result = run_python(
        "import os, time\nprint(os.getcwd(), flush=True)\nos.chmod('.', 0)\ntime.sleep(100)", timeout_s=0.5
    )
    assert result.timed_out and not os.path.exists(result.stdout.strip())


def test_output_is_bounded():
    result = run_python("import sys\nprint('x' * 10**6)\nsys.stderr.write('y' * 10**6)\nraise SystemExit('the end')")
    assert result.stdout == "x" * OUTPUT_LIMIT
    assert len(result.stderr) == OUTPUT_LIMIT and result.stderr.endswith("the end\n")
    assert result.returncode == 1


def test_runs_from_threads_at_once():
    results = [None] * 4

    def run(i):
        results[i] = run_python(f"print({i} * 2)")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(4)]


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="max_processes"):
        run_python("pass", max_processes=0)


SOLUTIONS = {
    "correct": "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.",
    "wrong": "```python\ndef add(a, b):\n    return a - b\n```",
    "looping": "```python\ndef add(a, b):\n    while True:\n        pass\n```",
}


@pytest.mark.parametrize(
    "solution, expected",
    [
        ("correct", {"reward": 1.0, "pass_rate": 1.0, "timeouts": 0, "killed": 0}),
        ("wrong", {"reward": 0.0, "pass_rate": 0.0, "timeouts": 0, "killed": 0}),
        ("looping", {"reward": 0.0, "pass_rate": 0.0, "timeouts": 1, "killed": 0}),
    ],
)
def test_code_reward_on_asserts(solution, expected):
    assert (
        code_reward("p", SOLUTIONS[solution], [], [], tests="assert add(1, 2) == 3\nassert add(0, 0) == 0") == expected
    )


def test_code_reward_on_a_list_of_asserts_and_on_io_cases():
    cases = ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]
    assert code_reward("p", SOLUTIONS["correct"], [], [], tests=cases)["pass_rate"] == 0.5
    io = "```py\na, b = map(int, input().split())\nprint(a + b)\n```"
    tests = '[{"input": "1 2\\n", "output": "3\\n"}, {"input": "5 5", "output": "10  \\n\\n"}]'
    assert code_reward("p", io, [], [], tests=tests) == {"reward": 1.0, "pass_rate": 1.0, "timeouts": 0, "killed": 0}
    wrong = [{"input": "1 2", "output": "4"}, {"input": "1 1", "output": "2"}]
    assert code_reward("p", io, [], [], tests=wrong)["pass_rate"] == 0.5


def test_code_reward_counts_a_program_killed_at_a_limit():
    bomb = "```python\nx = bytearray(10**10)\n```"
    assert code_reward("p", bomb, [], [], tests="pass") == {"reward": 0.0, "pass_rate": 0.0, "timeouts": 0, "killed": 1}
