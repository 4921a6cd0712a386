"""A reward whose module takes 3 s to import in a worker process (a large reward library, a loaded machine)."""

import multiprocessing
import time

if multiprocessing.parent_process() is not None:
    time.sleep(3)


def correct(prompt, completion, prompt_ids, completion_ids, **fields):
    return 1.0
