"""The embedded engine gathers returning turns: once a batch finishes, the next turns its agents send,
arriving staggered, are prefilled together in one forward pass (counted by the engine's pass counter),
where without gathering the first to arrive starts alone and the rest join later; the turns that come
back are admitted once the window closes even when fewer come back than left; the tokens do not
depend on it."""

import time
from concurrent.futures import Future

import pytest

from areal_hpc.models.hf import load_model
from areal_hpc.rollout.embedded_engine import EmbeddedGenerator, Request, Result, SamplingParams
from tests.rollout.test_server import PROMPT

EPISODES, NEW_TOKENS = 4, 6
GAP_S = 0.02  # between the next turns' arrivals: far below the test's window, far above a forward pass


def episode_params(episode: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0, sampling_seed=episode)


def submit(engine: EmbeddedGenerator, rid: str, prompt: list[int], params: SamplingParams) -> Future:
    future: Future = Future()
    engine.submit(Request(rid, prompt, params, future.set_result))
    return future


def two_turns(model_dir, gather_s: float, returning: int) -> tuple[int, list[Result]]:
    """``EPISODES`` first turns admitted together, then ``returning`` of them send their next turn, one every
    ``GAP_S`` s: the forward passes the engine ran for the next turns, and their results."""
    engine = EmbeddedGenerator(load_model(model_dir), slots=8, context_length=128, eos_token_ids=[], gather_s=gather_s)
    try:
        engine.pause().result()
        firsts = [submit(engine, f"e{i}-t0", PROMPT, episode_params(i)) for i in range(EPISODES)]
        engine.resume().result()
        answers = [f.result(60) for f in firsts]
        passes = engine.forward_passes
        nexts = []
        for i, answer in enumerate(answers[:returning]):
            if i:
                time.sleep(GAP_S)  # staggered, as a client handling one reply at a time sends them
            nexts.append(submit(engine, f"e{i}-t1", PROMPT + answer.output_ids + [7, 8], episode_params(i)))
        results = [f.result(60) for f in nexts]
        return engine.forward_passes - passes, results
    finally:
        engine.stop()


def test_next_turns_arriving_staggered_are_prefilled_in_one_pass(tiny_model_dir):
    passes, gathered = two_turns(tiny_model_dir, gather_s=1.0, returning=EPISODES)
    assert passes == NEW_TOKENS  # one prefill of all four, then NEW_TOKENS - 1 decode steps of all four
    ungathered_passes, ungathered = two_turns(tiny_model_dir, gather_s=0.0, returning=EPISODES)
    assert ungathered_passes > NEW_TOKENS  # the first arrival started alone: the test's staggering is real
    for a, b in zip(gathered, ungathered):  # a row's tokens do not depend on the batch it ran in
        assert a.error is None and b.error is None and a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_when_fewer_turns_come_back_than_left_those_that_do_start_once_the_window_closes(tiny_model_dir):
    passes, results = two_turns(tiny_model_dir, gather_s=0.2, returning=2)
    assert passes == NEW_TOKENS and all(len(r.output_ids) == NEW_TOKENS for r in results)
