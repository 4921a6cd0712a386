"""A large batch does not starve other callers: the engine admits waiting requests from their sources in
turn and leaves rows free of any one source, so a short request that arrives during a 3,000-prompt call
is answered within twice the forward passes it takes on an idle engine, long before the batch ends."""

import threading
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from areal_hpc.models.hf import load_model
from areal_hpc.rollout.embedded_engine import EmbeddedGenerator, Request, SamplingParams, admission_order
from tests.rollout.test_server import PROMPT
from tests.waiting import wait_for

BATCH = 3000


@given(
    st.dictionaries(st.text("abcdef", min_size=1, max_size=2), st.integers(-3, 40), max_size=6),
    st.integers(0, 64),
)
def test_admission_takes_sources_in_turn_within_their_room(room, free):
    picked = admission_order(room, free)
    counts = Counter(picked)
    open_room = {source: n for source, n in room.items() if n > 0}
    assert len(picked) == min(free, sum(open_room.values()))  # never idle rows while someone may start
    assert all(counts[source] <= n for source, n in open_room.items()) and set(counts) <= set(open_room)
    # water-filling, checked against the rounds: in round k every source with more than k of room is
    # picked once, in the dict's order, until the free rows run out
    deepest = max(open_room.values(), default=0)
    rounds = [source for k in range(deepest) for source in open_room if open_room[source] > k]
    assert picked == rounds[: len(picked)]


def passes_to_answer(engine: EmbeddedGenerator, rid: str, params: SamplingParams) -> int:
    """Forward passes the engine runs from submitting ``rid`` (one prompt, its own source) to its answer."""
    answered, passes = threading.Event(), {}

    def on_done(result) -> None:
        assert result.error is None and len(result.output_ids) == params.max_new_tokens
        passes["end"] = engine.forward_passes
        answered.set()

    passes["start"] = engine.forward_passes
    engine.submit(Request(rid, PROMPT, params, on_done))
    assert answered.wait(timeout=60), f"{rid} was not answered within 60 s"
    return passes["end"] - passes["start"]


def test_a_short_request_during_a_3000_prompt_batch_takes_at_most_twice_its_idle_passes(tiny_model_dir):
    engine = EmbeddedGenerator(load_model(tiny_model_dir), slots=32, context_length=256)
    assert engine.rows_per_source == 28  # 4 rows are always left to other sources
    eight = SamplingParams(max_new_tokens=8, ignore_eos=True)
    try:
        idle = passes_to_answer(engine, "idle", eight)
        assert idle == 8  # a prefill and 7 decode steps
        finished = []
        for i in range(BATCH):  # one source, as a /generate call's prompts are
            long = SamplingParams(max_new_tokens=16, ignore_eos=True)
            engine.submit(Request(f"batch-{i}", PROMPT, long, finished.append, source="batch"))
        wait_for(lambda: engine.running > 0, "the batch to start decoding")
        during = passes_to_answer(engine, "during", eight)
        assert during <= 2 * idle
        assert len(finished) < BATCH // 10  # answered long before the batch's end
    finally:
        engine.stop()
