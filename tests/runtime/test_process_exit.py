"""``runtime.exit.exit_process`` ends a process as the interpreter's exit would for the program: the
exit code, non-daemon threads joined, ``atexit`` handlers and ``weakref.finalize`` run, buffered output
flushed; and ``areal-hpc`` ends that way, without the module teardown (and without a word from
triton's extension, which reports leaks when a teardown leaves its objects alive)."""

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

PROGRAM = textwrap.dedent("""
    import atexit, sys, tempfile, threading, time, weakref
    from pathlib import Path
    from areal_hpc.runtime.exit import exit_process

    out = Path(sys.argv[1])
    def late_writer():
        time.sleep(0.3)
        (out / "thread").write_text("joined")
    threading.Thread(target=late_writer).start()
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    kept = tempfile.TemporaryDirectory(dir=out)  # removed by its weakref.finalize at exit
    sys.stdout.write("buffered, not flushed")
    exit_process(int(sys.argv[2]) if len(sys.argv) > 2 else None)
    (out / "after").write_text("exit_process returned")
""")


@pytest.mark.parametrize("code", [[], ["7"]], ids=["None is 0", "7"])
def test_a_process_ends_with_its_code_after_its_threads_atexit_handlers_and_output(tmp_path, code):
    ended = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path), *code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert ended.returncode == int(code[0] if code else 0), ended.stderr
    assert ended.stdout == "buffered, not flushed"
    assert (tmp_path / "thread").read_text() == "joined" and (tmp_path / "atexit").read_text() == "ran"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit", "thread"]  # temp dir removed, nothing after


def test_the_command_ends_without_tearing_down_modules(tmp_path):
    """A module-level object's ``__del__`` runs when the interpreter tears modules down: not after
    ``areal-hpc`` (that teardown costs a trainer ~1 s), and triton's extension, imported, says nothing."""
    script = tmp_path / "command.py"
    script.write_text(
        textwrap.dedent(f"""
        import torch, triton, transformers.models.qwen2.modeling_qwen2
        from areal_hpc.cli import run
        class TornDown:
            def __del__(self, open=open):  # builtins may be gone by then
                open({str(tmp_path / "torn_down")!r}, "w").close()
        marker = TornDown()
        run()
    """)
    )
    ended = subprocess.run(
        [sys.executable, str(script), "train", "--config", str(tmp_path / "missing.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ended.returncode == 2 and ended.stderr.count("\n") == 1 and "missing.yaml" in ended.stderr, ended.stderr
    assert not (tmp_path / "torn_down").exists()
    normal = subprocess.run([sys.executable, "-c", script.read_text().replace("run()", "")], cwd=REPO, timeout=120)
    assert normal.returncode == 0 and (tmp_path / "torn_down").exists()  # the marker works
