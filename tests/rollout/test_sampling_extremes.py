"""Sampling parameters at the edges of their number types, against a real embedded server on loopback.

Every sampling field gets the values where representations end (0, -1, 2**31, 2**63, 2**64, float32's
largest number and the next double above it, subnormals, inf, NaN): the request is served, or refused
with a one-line 400 naming the field, while the requests decoding beside it finish untouched. The
in-process test passes such values past validation: a request the sampler cannot take fails alone.
"""

import concurrent.futures
import json
import math
import reprlib
import threading

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from areal_hpc.models.hf import load_model
from areal_hpc.rollout.embedded_engine import EmbeddedGenerator, Request, SamplingParams
from tests.conftest import embedded_server
from tests.rollout.test_server import PROMPT, model_info, post, wait_for

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
ABOVE_FLOAT32_MAX = math.nextafter(FLOAT32_MAX, math.inf)  # rounds to float32's max, but does not fit it
INT64_MAX = 2**63 - 1
ROOM = 4  # the edge request's prompt leaves this many tokens of context: max_new_tokens 4 fits, 5 does not
INTS = [
    0,
    1,
    -1,
    -2,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    INT64_MAX,
    2**63,
    2**64,
    -(2**63),
    -(2**63) - 1,
    -(2**64),
    10**30,
    10**400,
]
FLOATS = [
    0.0,
    -0.0,
    5e-324,
    1e-310,
    1.401298464324817e-45,
    1e-40,
    1.1754943508222875e-38,
    9.99999e-07,
    1e-06,
    0.5,
    0.9999999999999999,
    1.0,
    1.0000000000000002,
    2.0,
    1e30,
    FLOAT32_MAX,
    ABOVE_FLOAT32_MAX,
    3.5e38,
    1.7976931348623157e308,
    math.inf,
    -math.inf,
    math.nan,
    -1.0,
    -FLOAT32_MAX,
]
BYSTANDERS = [dict(temperature=1.0, top_k=5), dict(temperature=0.7, top_p=0.9), dict(temperature=0)]
BYSTANDER_TOKENS = 24


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with embedded_server(tiny_model_dir, tmp_path_factory.mktemp("runs")) as (_, address):
        yield address


def vocab_size(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def finite(value) -> bool:
    """A JSON number (not a bool) that is a finite float."""
    if type(value) not in (int, float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def is_valid(field: str, value, vocab: int) -> bool:
    """What the sampler can take, written out independently of the server's checks."""
    if field == "max_new_tokens":
        return type(value) is int and 0 <= value <= ROOM
    if field == "temperature":
        return finite(value) and (value == 0 or 1e-6 <= value <= FLOAT32_MAX)
    if field == "top_p":
        return finite(value) and 0 < value <= 1
    if field == "top_k":  # above the vocabulary it keeps every token, as SGLang does
        return type(value) is int and (value == -1 or 1 <= value <= INT64_MAX)
    if field == "stop_token_ids":
        return type(value) is list and all(type(t) is int and 0 <= t < vocab for t in value)
    if field == "sampling_seed":
        return value is None or (type(value) is int and 0 <= value <= INT64_MAX)
    assert field == "ignore_eos"
    return type(value) is bool


def edges(extra_ints: tuple[int, ...] = ()) -> st.SearchStrategy:
    return st.sampled_from(INTS + list(extra_ints) + FLOATS) | st.integers() | st.floats() | st.booleans()


def sampling_params(vocab: int) -> st.SearchStrategy:
    """One sampling field at an edge, or any subset of them (max_new_tokens is 2 when not drawn)."""
    fields = {
        "max_new_tokens": edges((ROOM, ROOM + 1)),
        "temperature": edges(),
        "top_p": edges(),
        "top_k": edges((vocab - 1, vocab, vocab + 1)),
        "stop_token_ids": st.lists(st.sampled_from(INTS + [vocab - 1, vocab]) | st.integers(), max_size=3) | edges(),
        "ignore_eos": edges(),
        "sampling_seed": edges() | st.none(),
    }
    one = st.sampled_from(sorted(fields)).flatmap(lambda name: st.fixed_dictionaries({name: fields[name]}))
    return one | st.fixed_dictionaries({}, optional=fields)


# always tried: the values the defect was found with, and the largest valid ones
HEADLINE = [
    {"top_k": 2**63},
    {"top_k": 2**64},
    {"top_k": INT64_MAX, "top_p": 0.5},
    {"top_k": -(2**63)},
    {"temperature": ABOVE_FLOAT32_MAX},
    {"temperature": FLOAT32_MAX},
    {"temperature": 1e308},
    {"temperature": 2**128},
    {"top_p": 5e-324},
    {"top_p": math.nan},
    {"max_new_tokens": ROOM},
    {"max_new_tokens": ROOM + 1},
    {"max_new_tokens": 2**64},
    {"stop_token_ids": [2**64]},
    {"stop_token_ids": [-1]},
    {"ignore_eos": 1},
    {"temperature": 1e-6, "ignore_eos": True},
    {"max_new_tokens": ROOM, "temperature": FLOAT32_MAX, "top_p": 5e-324, "top_k": INT64_MAX},
]


def test_sampling_values_at_numeric_edges_get_200_or_a_400_naming_the_field_and_bystanders_finish(
    server, tiny_model_dir
):
    vocab = vocab_size(tiny_model_dir)
    context = model_info(server)["context_length"]
    prompt = (PROMPT * context)[: context - ROOM]
    bystanders, done = [], threading.Event()

    def keep_requests_running(sampling):
        while not done.is_set():
            bystanders.append(
                post(
                    server,
                    "/generate",
                    {
                        "input_ids": PROMPT,
                        "sampling_params": {"max_new_tokens": BYSTANDER_TOKENS, "ignore_eos": True, **sampling},
                    },
                )
            )

    threads = [threading.Thread(target=keep_requests_running, args=(s,)) for s in BYSTANDERS]
    for thread in threads:
        thread.start()

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(sampling=sampling_params(vocab))
    def one_request(sampling):
        sampling = {"max_new_tokens": 2, **sampling}
        status, reply = post(server, "/generate", {"input_ids": prompt, "sampling_params": sampling})
        invalid = [field for field, value in sampling.items() if not is_valid(field, value, vocab)]
        if not invalid:
            assert status == 200, (sampling, reply)
            assert reply["meta_info"]["finish_reason"]["type"] in ("length", "stop"), (sampling, reply)
            assert len(reply["output_ids"]) <= sampling["max_new_tokens"]
            return
        assert status == 400, (sampling, reply)
        message = reply["error"]["message"]
        assert "\n" not in message and len(message) < 300, message
        named = [
            f
            for f in invalid
            if f"sampling_params.{f} = {reprlib.repr(sampling[f])};" in message
            or (f == "max_new_tokens" and f"+ {reprlib.repr(sampling[f])} max_new_tokens >" in message)
        ]
        assert named, (sampling, message)  # the field and its value

    for sampling in HEADLINE + [{"top_k": vocab + 1}, {"stop_token_ids": [vocab - 1]}, {"stop_token_ids": [vocab]}]:
        one_request = example(sampling=sampling)(one_request)
    try:
        wait_for(lambda: model_info(server)["running_requests"] >= 1, "the bystanders to run")
        one_request()
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=120)
    assert len(bystanders) >= len(BYSTANDERS)
    for status, reply in bystanders:
        assert status == 200, reply
        assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": BYSTANDER_TOKENS}, reply


def test_a_request_the_sampler_cannot_take_fails_alone_in_the_engine(tiny_model_dir):
    """Past validation (SamplingParams built directly), a top_k beyond int64 or a temperature beyond
    float32 fails its own request at admission; those prefilled with it and those decoding finish."""
    engine = EmbeddedGenerator(load_model(tiny_model_dir), slots=8, context_length=256)
    results, all_done = {}, threading.Event()

    def on_done(result):
        results[result.rid] = result
        if len(results) == 6:
            all_done.set()

    def request(rid, **sampling):
        return Request(rid, PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True, **sampling), on_done)

    batch = [
        request("huge-top-k", top_k=2**63),
        request("beside", temperature=0.8),
        request("huge-temperature", temperature=1e39),
        request("last", top_p=0.9),
    ]
    running_at_batch = concurrent.futures.Future()

    def submit_batch():  # on the engine thread, the step after the two were prefilled: they are decoding
        running_at_batch.set_result(engine.running)
        for r in batch:
            engine.submit(r)  # admitted together in one prefill

    def submit_decoding():  # a command queued here runs on the next loop turn, after this one's admit + step
        for rid in ("decoding-1", "decoding-2"):
            engine.submit(request(rid, top_k=5))
        engine.call(submit_batch)

    try:
        engine.call(submit_decoding)
        assert running_at_batch.result(timeout=60) == 2
        assert all_done.wait(timeout=120)
    finally:
        engine.stop()
    for rid in ("huge-top-k", "huge-temperature"):
        assert results[rid].error is not None and results[rid].error.endswith("(output token 0)"), results[rid]
    for rid in ("decoding-1", "decoding-2", "beside", "last"):
        result = results[rid]
        assert result.error is None and result.finish_reason == "length" and len(result.output_ids) == 20, result
