"""End a process as soon as its program is done, without the interpreter's module teardown.

CPython's exit joins the program's non-daemon threads, runs its ``atexit`` handlers, flushes the
standard streams, and then tears down every module, collecting garbage several times over all the
objects torch and transformers created at import. That last part does nothing a finished run needs
and takes 1.0-1.5 s per process on a 2-core machine (0.4-0.5 s for ``import torch`` alone): a launcher,
its rollout server and its trainer spent ~3 s ending a run whose steps took 1 s. ``exit_process``
does the first three, as the interpreter would, and then ends the process with ``os._exit``.

What the program must leave behind is written before it returns: shard writers and checkpoints are
closed and fsynced explicitly (a run must survive SIGKILL anyway), process groups destroyed, and
``weakref.finalize`` objects and ``logging`` run as ``atexit`` handlers. Skipped are ``__del__``
methods of objects still alive at exit and C-level ``atexit`` handlers, as for any ``os._exit``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int | None) -> NoReturn:
    """Join non-daemon threads, run the ``atexit`` handlers, flush stdout and stderr, and end the
    process with ``code`` (None is 0, as for ``sys.exit``)."""
    threading._shutdown()  # what the interpreter's exit calls first: waits for non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be written to it
            pass
    os._exit(code or 0)
