"""Reward functions that misbehave on purpose; module-level so reward worker processes can import them."""

import os
import time


def hangs(completion, example):
    if completion == "hang":
        time.sleep(3600)
    return 1.0


def raises(completion, example):
    if completion == "boom":
        raise ValueError("bad reward code")
    return 1.0


def exits(completion, example):
    if completion == "die":
        os._exit(1)
    return 1.0


def hangs_always(completion, example):
    time.sleep(3600)


def exact_answer(completion, example):
    from areal_hpc.data.rewards import last_number, parse_number

    return float(last_number(completion) == parse_number(example.answer))


def raises_always(completion, example):
    raise ValueError(f"reward code cannot parse {completion[:10]!r}")
