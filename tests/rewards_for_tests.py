"""Reward functions for tests (most misbehave on purpose); module-level so reward worker processes can import them.
Each has the reward signature: (prompt, completion, prompt_ids, completion_ids, **fields)."""

import os
import time


def hangs(prompt, completion, prompt_ids, completion_ids, **fields):
    if completion == "hang":
        time.sleep(3600)
    return 1.0


def raises(prompt, completion, prompt_ids, completion_ids, **fields):
    if completion == "boom":
        raise ValueError("bad reward code")
    return 1.0


def exits(prompt, completion, prompt_ids, completion_ids, **fields):
    if completion == "die":
        os._exit(1)
    return 1.0


def not_a_number(prompt, completion, prompt_ids, completion_ids, **fields):
    return {"nan": float("nan"), "text": "1.0", "none": None, "dict": {"score": 1.0}}.get(completion, 1.0)


def hangs_always(prompt, completion, prompt_ids, completion_ids, **fields):
    time.sleep(3600)


def exact_answer(prompt, completion, prompt_ids, completion_ids, answer, **fields):
    from areal_hpc.data.rewards import last_number, parse_number

    return float(last_number(completion) == parse_number(answer))


def raises_always(prompt, completion, prompt_ids, completion_ids, **fields):
    raise ValueError(f"reward code cannot parse {completion[:10]!r}")


def digit_share(prompt, completion, prompt_ids, completion_ids, **fields):
    """The share of the completion's characters that are digits: a reward even an untrained model's
    samples differ in, so every group has advantages to learn from."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def scored_where(prompt, completion, prompt_ids, completion_ids, **fields):
    """1.0, and as metrics the process and thread that scored it."""
    import threading

    return {"reward": 1.0, "pid": float(os.getpid()), "thread": float(threading.get_ident())}


class ScoresInBatches:
    """A reward with ``score_batch``: each completion's length, and the size of the batch it came in as a
    metric; a batch holding "short" returns one result too few, "boom" raises, "nan" is that item's value."""

    def __call__(self, prompt, completion, prompt_ids, completion_ids, **fields):
        raise AssertionError("the pool calls score_batch")

    def score_batch(self, requests):
        if any(r.completion == "boom" for r in requests):
            raise ValueError("bad batch code")
        results = [
            float("nan")
            if r.completion == "nan"
            else {"reward": float(len(r.completion)), "batch": float(len(requests))}
            for r in requests
        ]
        return results[:-1] if any(r.completion == "short" for r in requests) else results


scores_in_batches = ScoresInBatches()
