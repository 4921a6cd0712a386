"""Run untrusted Python (a model's program) under limits: CPU time, address space, file size, processes,
a wall clock, bounded output, a throw-away working directory, and no network where the OS allows it.

``run_python`` starts this very file as a launcher in a fresh isolated interpreter (not a ``preexec_fn``,
which is unsafe in a threaded caller). The launcher makes itself the subreaper of everything the program
starts (an orphan, even one that called setsid(), stays below it), moves into new network and PID
namespaces where it may (root or CAP_SYS_ADMIN), and forks a child that sets the rlimits and execs the
program. It reports the program's exit status and CPU time on a pipe, then kills and reaps whatever the
program left behind. The caller enforces the wall clock and the process count and, at a limit, kills the
launcher's descendants; so nothing outlives the call.

With max_processes=1 (the default) the kernel refuses every new process or thread: a seccomp filter
makes fork, vfork, clone and clone3 fail with EAGAIN, for root and other users alike (RLIMIT_NPROC=0
backs it up for non-root users, on CPUs the filter does not know). With more, the process-count watchdog
(checked every POLL_S) is the limit, which a fork bomb on a loaded machine can outrun (details in
docs/rewards.md). Either way the program keeps the file access of the user running it: this bounds
resources and processes; it is not a filesystem jail.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# A SIGKILL the sandbox did not send is the CPU limit's once the program used this share of its CPU seconds.
# Not ~1: the kernel checks RLIMIT_CPU against tick-sampled CPU time, which on a loaded or virtualised
# machine runs ahead of the precise time wait4 reports (with both cores busy, a 1 s limit killed loops that
# wait4 timed at 0.88-0.95 s). A program that SIGKILLs itself after half its budget is the rare case this
# misnames.
CPU_KILL_SHARE = 0.5
OUTPUT_LIMIT = 64 * 1024  # bytes kept of stdout (its head) and of stderr (its tail: where a traceback ends)
POLL_S = 0.01  # how often the wall clock and the process count are checked
GRACE_S = 1.0  # the launcher's time to report and exit once its program is killed
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 36, 38, 22
CLONE_NEWNET, CLONE_NEWPID = 0x40000000, 0x20000000


@dataclass(frozen=True)
class SandboxResult:
    returncode: int  # negative: the signal that ended the program
    stdout: str
    stderr: str
    timed_out: bool  # stopped by the wall clock
    killed_by: str | None  # the limit that ended it: cpu, memory, file_size, wall_clock, processes
    duration_s: float
    network_isolated: bool  # ran in its own network (loopback down, no route) and PID namespaces


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    cpu_s: int = 5,
    memory_mb: int = 256,
    file_size_mb: int = 1,
    max_processes: int = 1,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a new temporary directory, fed ``stdin``. ``max_processes`` counts
    the program itself: 1 lets it start no process."""
    if timeout_s <= 0 or cpu_s < 1 or memory_mb < 1 or file_size_mb < 0 or max_processes < 1:
        raise ValueError("sandbox limits must be positive, and max_processes at least 1")
    workdir = tempfile.mkdtemp(prefix="areal-sandbox-")
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        limits = (cpu_s, memory_mb << 20, file_size_mb << 20, 0 if max_processes == 1 else -1)
        return _supervise(workdir, limits, stdin.encode(), timeout_s, max_processes)
    finally:
        _remove_tree(workdir)


def _supervise(workdir: str, limits: tuple, stdin: bytes, timeout_s: float, max_processes: int) -> SandboxResult:
    started = time.monotonic()
    status_r, status_w = os.pipe()
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(status_w), str(os.getpid()), *map(str, limits)],
            cwd=workdir,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
        )
    finally:
        os.close(status_w)
    out, err, status = bytearray(), bytearray(), bytearray()
    buffers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, status_r: status}
    with proc, selectors.DefaultSelector() as sel:
        try:
            reason = _watch(proc, sel, buffers, status_r, stdin, started + timeout_s, max_processes)
        finally:  # the tree is gone already, unless the launcher was killed or this raised
            _kill_descendants(proc.pid)
            proc.kill()
            _drain(sel, buffers)
            os.close(status_r)
    return _result(
        bytes(status).decode().splitlines(), proc.returncode, out, err, reason, limits[0], time.monotonic() - started
    )


def _watch(proc, sel, buffers: dict, status_r: int, stdin: bytes, deadline: float, max_processes: int):
    """Pass the program its input and collect its output until the launcher exits (closing the status
    pipe); stop it at the wall clock or when it runs too many processes. Returns that limit, or None."""
    for fd in buffers:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    pending, reason, killed_at, next_count = memoryview(stdin), None, 0.0, 0.0
    while status_r in sel.get_map():
        for key, _ in sel.select(POLL_S):
            if key.fd in buffers:
                _read(sel, key.fd, buffers[key.fd])
            else:
                pending = _feed(sel, proc.stdin, pending)
        now = time.monotonic()
        if reason is None and now > deadline:
            reason, killed_at = "wall_clock", now
        elif reason is None and now >= next_count:
            next_count = now + POLL_S
            if len(_descendants(proc.pid)) > max_processes:
                reason, killed_at = "processes", now
        if reason is not None:
            _kill_descendants(proc.pid)
            if now > killed_at + GRACE_S:  # the launcher itself is stuck: it reports nothing then
                proc.kill()
    if not proc.stdin.closed:
        sel.unregister(proc.stdin.fileno())
        proc.stdin.close()
    return reason


def _feed(sel, pipe, pending: memoryview) -> memoryview:
    try:
        pending = pending[os.write(pipe.fileno(), pending[:65536]) :]
    except BlockingIOError:
        return pending
    except BrokenPipeError:  # the program stopped reading
        pending = pending[:0]
    if not pending:
        sel.unregister(pipe.fileno())
        pipe.close()
    return pending


def _read(sel, fd: int, buffer: bytearray) -> None:
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return
    if not chunk:
        sel.unregister(fd)
        return
    buffer += chunk
    if len(buffer) > 2 * OUTPUT_LIMIT:  # keep both ends: stdout is cut to its head, stderr to its tail
        del buffer[OUTPUT_LIMIT:-OUTPUT_LIMIT]


def _drain(sel, buffers: dict) -> None:
    """Read the output pipes to their end (every writer is dead by now; the bound is for safety)."""
    until = time.monotonic() + GRACE_S
    while any(fd in sel.get_map() for fd in buffers) and time.monotonic() < until:
        for key, _ in sel.select(POLL_S):
            if key.fd in buffers:  # not stdin, still registered when _watch raised
                _read(sel, key.fd, buffers[key.fd])


def _children() -> dict[int, list[int]]:
    """ppid -> the live (not zombie) processes it is the parent of, from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
            except (OSError, ValueError):  # gone meanwhile
                continue
            if state not in (b"Z", b"X"):
                children.setdefault(int(ppid), []).append(int(name))
    return children


def _descendants(pid: int) -> list[int]:
    """The live processes below ``pid``; the launcher is a subreaper, so no orphan escapes this tree."""
    children, found = _children(), []
    todo = list(children.get(pid, ()))
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], ()))
    return found


def _kill_descendants(pid: int) -> None:
    """SIGKILL the processes below ``pid`` until none is alive (a killed process cannot fork any more)."""
    for _ in range(1000):
        alive = _descendants(pid)
        if not alive:
            return
        for p in alive:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)
    raise RuntimeError(f"sandbox: processes {alive} survived SIGKILL")


def _result(
    status: list[str],
    launcher_rc: int,
    out: bytearray,
    err: bytearray,
    reason: str | None,
    cpu_limit: int,
    duration_s: float,
) -> SandboxResult:
    stdout = bytes(out[:OUTPUT_LIMIT]).decode(errors="replace")
    stderr = bytes(err[-OUTPUT_LIMIT:]).decode(errors="replace")
    if len(status) == 2:  # the launcher saw its program end: "<wait status> <cpu seconds>"
        wait_status, cpu = status[1].split()
        returncode = os.waitstatus_to_exitcode(int(wait_status))
        if (
            reason is None
            and returncode in (-signal.SIGKILL, -signal.SIGXCPU)
            and float(cpu) >= CPU_KILL_SHARE * cpu_limit
        ):
            reason = "cpu"
    else:  # the launcher failed (and said why on stderr), or was killed
        returncode = launcher_rc
    if reason is None and returncode != 0:
        reason = _limit_in_traceback(stderr)
    return SandboxResult(returncode, stdout, stderr, reason == "wall_clock", reason, duration_s, status[:1] == ["1"])


def _limit_in_traceback(stderr: str) -> str | None:
    """The limit a program died of when the kernel refused it something and Python raised."""
    last = stderr.strip().rsplit("\n", 1)[-1]
    if last.startswith("MemoryError") or "[Errno 12]" in last:  # ENOMEM: RLIMIT_AS
        return "memory"
    if "[Errno 27]" in last:  # EFBIG: RLIMIT_FSIZE (Python ignores SIGXFSZ, so the write fails)
        return "file_size"
    if last.startswith("BlockingIOError") and "[Errno 11]" in last:  # EAGAIN from fork: seccomp, RLIMIT_NPROC
        return "processes"
    if last == "RuntimeError: can't start new thread":  # the same refusal, to a thread
        return "processes"
    return None


def _remove_tree(path: str) -> None:
    """Remove the working directory whatever the program left there: chmod 000 directories (coreutils'
    chmod -R skips symbolic links) and trees too deep for Python's recursive walk."""
    subprocess.run(["chmod", "-R", "u+rwx", "--", path], capture_output=True)
    subprocess.run(["rm", "-rf", "--", path], capture_output=True)
    if os.path.lexists(path):
        raise OSError(f"sandbox: cannot remove its working directory {path}")


def _launch(status_fd: int, parent: int, cpu_s: int, memory_b: int, file_size_b: int, nproc: int) -> None:
    """The launcher (this file run as a script). Writes "<1 if isolated else 0>" first, then
    "<wait status> <cpu seconds>" once the program ends, and exits once all it started is dead."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the caller dies (a reward worker killed): so do we
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    isolated = libc.unshare(CLONE_NEWNET | CLONE_NEWPID) == 0
    os.set_inheritable(status_fd, False)
    os.write(status_fd, f"{int(isolated)}\n".encode())
    pid = os.fork()
    if pid == 0:
        try:  # in a PID namespace this child is its init: its death ends every process there
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            for limit, value in (
                (resource.RLIMIT_CPU, cpu_s),
                (resource.RLIMIT_AS, memory_b),
                (resource.RLIMIT_FSIZE, file_size_b),
                (resource.RLIMIT_CORE, 0),
            ):
                resource.setrlimit(limit, (value, value))
            if nproc == 0:
                _refuse_new_processes(libc)
            if nproc >= 0 and os.geteuid() != 0:  # root ignores RLIMIT_NPROC
                resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            os.execv(sys.executable, [sys.executable, "-I", "-S", "main.py"])
        finally:
            os._exit(127)
    _, wait_status, usage = os.wait4(pid, 0)
    os.write(status_fd, f"{wait_status} {usage.ru_utime + usage.ru_stime}\n".encode())
    while True:  # orphans the program left (they are our children now): kill them, reap everything
        for child in _children().get(os.getpid(), ()):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.wait()
        except ChildProcessError:
            return


# Per CPU: the audit arch seccomp reports, and the numbers of the system calls that start a process or thread
# (fork and vfork, where the CPU has them; clone; clone3, which glibc tries first for a thread).
_PROCESS_SYSCALLS = {
    "x86_64": (0xC000003E, (57, 58, 56, 435)),
    "aarch64": (0xC00000B7, (220, 435)),
    "ppc64le": (0xC0000015, (2, 189, 120, 435)),
}


class _SockFilter(ctypes.Structure):  # struct sock_filter: one classic BPF instruction
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _refuse_new_processes(libc) -> bool:
    """Install a seccomp filter under which every call that starts a process or thread fails with EAGAIN
    (as RLIMIT_NPROC=0 does for a non-root user); so does every call of another ABI (x86's 32-bit one).
    Returns False, changing nothing, on a CPU not in the table or a kernel without seccomp."""
    arch_syscalls = _PROCESS_SYSCALLS.get(platform.machine())
    if arch_syscalls is None:
        return False
    arch, numbers = arch_syscalls
    load_word, jump_eq, jump_ge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JMP|JGE|K, BPF_RET|K
    refuse, allow = 0x00050000 | 11, 0x7FFF0000  # SECCOMP_RET_ERRNO | EAGAIN, SECCOMP_RET_ALLOW
    checks = [*numbers, 0x40000000]  # the last: x32's numbers (__X32_SYSCALL_BIT), refused with the rest
    program = [(load_word, 0, 0, 4), (jump_eq, 1, 0, arch), (ret, 0, 0, refuse), (load_word, 0, 0, 0)]
    for i, number in enumerate(checks):
        to_refuse = len(checks) - i  # past the remaining checks and the allow
        program.append((jump_ge if number == 0x40000000 else jump_eq, to_refuse, 0, number))
    program += [(ret, 0, 0, allow), (ret, 0, 0, refuse)]
    instructions = (_SockFilter * len(program))(*(_SockFilter(*row) for row in program))
    fprog = _SockFprog(len(program), instructions)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(fprog)) == 0  # SECCOMP_MODE_FILTER


if __name__ == "__main__":
    _launch(*map(int, sys.argv[1:]))
