"""The embedded rollout server on loopback: SGLang's routes, logprob parity, pause/abort, bad requests.

Tests here share one server and leave it as they found it (never paused, weights of version 0);
tests that change weights are in test_weights.py and start their own.
"""

import contextlib
import json
import threading
import urllib.error
import urllib.request

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from areal_hpc.models.hf import load_model, load_tokenizer, save_model
from tests.conftest import embedded_server
from tests.waiting import wait_for

PROMPT = [5, 17, 33, 2, 9]


def post(address: str, route: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body or {}).encode()
    request = urllib.request.Request(f"http://{address}{route}", data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, strict_json(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, strict_json(exc.read())


def strict_json(data: bytes):
    """Parse as a strict client would: NaN or Infinity in a reply is an error."""

    def refuse(constant):
        raise ValueError(f"reply holds {constant}, which is not JSON")

    return json.loads(data, parse_constant=refuse)


def generate(address: str, prompt=PROMPT, **sampling) -> dict:
    status, reply = post(
        address,
        "/generate",
        {"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 8, **sampling}},
    )
    assert status == 200, reply
    return reply


def model_info(address: str) -> dict:
    with urllib.request.urlopen(f"http://{address}/get_model_info", timeout=30) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def paused(address: str):
    """The server paused (abort mode) for the block, then continued whatever happens. Requests sent
    meanwhile wait in its queue, a state that lasts until it continues (``wait_queued`` waits for it);
    on the continue the engine admits them, prefilling each a first token, before it takes any later
    command (a pause, an abort): so right after the block they are decoding, without a poll for a
    request to be running, which it may finish before the poll sees it."""
    assert post(address, "/pause_generation", {"mode": "abort"}) == (200, {"success": True})
    try:
        yield
    finally:
        assert post(address, "/continue_generation")[0] == 200


def wait_queued(address: str, count: int, what: str, timeout_s: float = 60) -> None:
    """Wait until ``count`` requests wait in the queue of the paused server at ``address``."""
    wait_for(
        lambda: model_info(address)["waiting_requests"] == count, what, timeout_s, seen=lambda: model_info(address)
    )


def in_background(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """Run ``fn(*args, **kwargs)`` in a thread; its return value lands in ``out["result"]``."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=fn(*args, **kwargs)))
    thread.start()
    return thread, out


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with embedded_server(tiny_model_dir, tmp_path_factory.mktemp("runs")) as (_, address):
        yield address


def teacher_forced_logprobs(model_dir, prompt, output) -> torch.Tensor:
    model = load_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def assert_teacher_forced(reply: dict, model_dir, prompt=PROMPT) -> None:
    """The reply's logprobs (temperature 1) are those of a teacher-forced pass: nothing disturbed it."""
    served = torch.tensor([entry[0] for entry in reply["meta_info"]["output_token_logprobs"]])
    expected = teacher_forced_logprobs(model_dir, prompt, reply["output_ids"])
    assert torch.allclose(served, expected, atol=1e-4), (served - expected).abs().max()


def test_generate_returns_sglang_shape_with_logprobs_equal_to_a_teacher_forced_pass(server, tiny_model_dir):
    reply = generate(server, max_new_tokens=12, temperature=1.0, ignore_eos=True)
    meta = reply["meta_info"]
    assert len(reply["output_ids"]) == meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12} and meta["prompt_tokens"] == len(PROMPT)
    assert [entry[1] for entry in meta["output_token_logprobs"]] == reply["output_ids"]
    assert meta["output_token_versions"] == [0] * 12 and isinstance(reply["text"], str)
    assert_teacher_forced(reply, tiny_model_dir)


def test_input_logprobs_follow_sglang_scoring_contract(server, tiny_model_dir):
    """SGLang's scoring path (what on-policy distillation asks of a teacher): max_new_tokens 0 and
    logprob_start_len k give one [logprob, token, null] per position k.., the first logprob null, the
    others those of a teacher-forced pass; a batch answers each prompt; -1 (the default) gives none."""
    sequence = PROMPT + [40, 41, 7, 3]
    for start in (0, 1, 4, len(sequence) - 1):
        status, reply = post(
            server,
            "/generate",
            {
                "input_ids": sequence,
                "return_logprob": True,
                "logprob_start_len": start,
                "sampling_params": {"max_new_tokens": 0},
            },
        )
        assert status == 200 and reply["output_ids"] == [], reply
        entries = reply["meta_info"]["input_token_logprobs"]
        assert [token for _, token, _ in entries] == sequence[start:] and entries[0][0] is None
        expected = teacher_forced_logprobs(tiny_model_dir, sequence[: start + 1], sequence[start + 1 :])
        assert torch.allclose(torch.tensor([lp for lp, _, _ in entries[1:]]), expected, atol=1e-4)
    status, replies = post(
        server,
        "/generate",
        {
            "input_ids": [sequence, PROMPT],
            "return_logprob": True,
            "logprob_start_len": 2,
            "sampling_params": {"max_new_tokens": 0},
        },
    )
    assert status == 200 and [len(r["meta_info"]["input_token_logprobs"]) for r in replies] == [len(sequence) - 2, 3]
    assert "input_token_logprobs" not in generate(server, max_new_tokens=2)["meta_info"]


def test_logprobs_are_of_the_tempered_distribution_before_truncation_and_greedy_reports_temperature_1(
    server, tiny_model_dir
):
    model = load_model(tiny_model_dir)
    for sampling in [dict(temperature=0.7, top_k=3), dict(temperature=1.5, top_p=0.5), dict(temperature=0)]:
        reply = generate(server, max_new_tokens=6, ignore_eos=True, **sampling)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + reply["output_ids"]])).logits[0, len(PROMPT) - 1 : -1].float()
        expected = torch.log_softmax(logits / (sampling["temperature"] or 1.0), -1)
        expected = expected.gather(1, torch.tensor(reply["output_ids"])[:, None])[:, 0]
        served = torch.tensor([entry[0] for entry in reply["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(served, expected, atol=1e-4), (sampling, (served - expected).abs().max())


def test_batched_prompts_stop_tokens_and_greedy_determinism(server):
    greedy = generate(server, temperature=0)
    again = generate(server, temperature=0)
    assert greedy["output_ids"] == again["output_ids"]
    first = greedy["output_ids"][0]
    stopped = generate(server, temperature=0, stop_token_ids=[first])
    assert stopped["output_ids"] == [first]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    status, replies = post(
        server,
        "/generate",
        {
            "input_ids": [PROMPT, PROMPT[:2]],
            "rid": ["a", "b"],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        },
    )
    assert status == 200 and [r["meta_info"]["id"] for r in replies] == ["a", "b"]
    assert replies[0]["output_ids"] == greedy["output_ids"][:3]


def test_pause_returns_partial_outputs_and_queues_new_work_until_continue(server):
    with paused(server):
        running, results = in_background(generate, server, max_new_tokens=900, ignore_eos=True)
        wait_queued(server, 1, "the long request to wait in the paused server's queue")
    try:  # continued: the long request is decoding when the pause below is taken
        assert post(server, "/pause_generation", {"mode": "abort"}) == (200, {"success": True})
        running.join(timeout=60)
        partial = results["result"]
        assert partial["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(partial["output_ids"]) < 900
        queued, later = in_background(generate, server, max_new_tokens=4)
        wait_queued(server, 1, "the new request to be queued")
        assert "result" not in later and model_info(server)["running_requests"] == 0  # held while paused
    finally:  # the server is shared by the module's tests: never leave it paused
        assert post(server, "/continue_generation")[0] == 200
    queued.join(timeout=60)
    assert len(later["result"]["output_ids"]) >= 1


def test_abort_request_by_id(server):
    with paused(server):
        worker, results = in_background(
            post,
            server,
            "/generate",
            {"input_ids": PROMPT, "rid": "victim", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}},
        )
        wait_queued(server, 1, "the request to wait in the paused server's queue")
    assert post(server, "/abort_request", {"rid": "victim"})[0] == 200  # decoding when the abort is taken
    worker.join(timeout=60)
    assert results["result"][1]["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize("field, value", [("abort_all", "no"), ("abort_all", 1), ("rid", 7)])
def test_abort_request_flags_are_booleans_not_truthy_values(server, field, value, tiny_model_dir):
    # asked while the request waits in the paused server's queue, where it stays: an abort the engine
    # took would end it there (an abort ends queued requests as it ends decoding ones)
    with paused(server):
        worker, results = in_background(generate, server, max_new_tokens=150, ignore_eos=True)
        wait_queued(server, 1, "the request to wait in the paused server's queue")
        status, reply = post(server, "/abort_request", {field: value})
    assert status == 400 and f"{field} = {value!r}" in reply["error"]["message"], reply
    worker.join(timeout=120)
    assert results["result"]["meta_info"]["finish_reason"]["type"] == "length"  # not aborted


def test_a_temperature_below_the_floor_is_refused_and_running_requests_carry_on(server, tiny_model_dir):
    with paused(server):
        workers = [
            in_background(generate, server, PROMPT[: i + 1], max_new_tokens=200, ignore_eos=True) for i in range(5)
        ]
        wait_queued(server, 5, "five requests to wait in the paused server's queue")
    status, reply = post(
        server, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "temperature": 1e-40}}
    )
    assert status == 400, reply
    assert reply["error"]["message"] == (
        "sampling_params.temperature = 1e-40; it must be 0 (greedy) or a finite number >= 1e-06"
    )
    for i, (worker, out) in enumerate(workers):
        worker.join(timeout=120)
        assert out["result"]["meta_info"]["finish_reason"]["type"] == "length"
        assert_teacher_forced(out["result"], tiny_model_dir, PROMPT[: i + 1])


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "body is not valid JSON"),
        (b"[1, 2]", "body must be a JSON object"),
        (b'{"input_ids": [1], "rid": "\xff\xfe"}', "body is not UTF-8 text"),
        (b'{"input_ids": [1], "rid": ' + b"7" * 5000 + b"}", "body is not valid JSON (Exceeds the limit"),
        (b"[" * 100_000 + b"]" * 100_000, "body nests arrays or objects too deeply"),
        (b'{"input_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}", "body nests arrays or objects too deeply"),
        (json.dumps({"input_ids": "hello"}).encode(), "input_ids must be a list of non-negative integers"),
        (
            json.dumps({"input_ids": [1], "sampling_params": {"temperature": "hot"}}).encode(),
            "sampling_params.temperature = 'hot'; it must be 0 (greedy) or a finite number >= 1e-06",
        ),
        (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "sampling_params.temperature = nan"),
        (b'{"input_ids": [1], "sampling_params": {"temperature": Infinity}}', "sampling_params.temperature = inf"),
        (
            json.dumps({"input_ids": [1], "sampling_params": {"temperature": 10**400}}).encode(),
            "sampling_params.temperature = 1000000000",
        ),
        (
            json.dumps({"input_ids": [1], "sampling_params": {"top_p": 0}}).encode(),
            "sampling_params.top_p = 0; it must be a number in (0, 1]",
        ),
        (
            json.dumps({"input_ids": [1], "sampling_params": {"ignore_eos": "false"}}).encode(),
            "sampling_params.ignore_eos = 'false'; it must be true or false",
        ),
        (
            json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}}).encode(),
            "too many tokens: 1 prompt + 5000 max_new_tokens > context length 1024",
        ),
        (
            json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**400}}).encode(),
            "too many tokens: 1 prompt + 1000000000",
        ),
        (json.dumps({"input_ids": [10**6]}).encode(), "the vocabulary has"),
        (
            json.dumps({"input_ids": [1], "sampling_params": {"best_of": 2}}).encode(),
            "unknown sampling_params ['best_of']",
        ),
        (json.dumps({"input_ids": [1], "lora_path": "x"}).encode(), "unknown fields ['lora_path']"),
        (json.dumps({"input_ids": [1], "stream": "false"}).encode(), "stream = 'false'; it must be true or false"),
        (
            json.dumps({"input_ids": [1], "return_logprob": "no"}).encode(),
            "return_logprob = 'no'; it must be true or false",
        ),
        (json.dumps({"input_ids": [1], "return_logprob": 1}).encode(), "return_logprob = 1; it must be true or false"),
        (
            json.dumps({"input_ids": [1, 2], "logprob_start_len": 2}).encode(),
            "logprob_start_len = 2; it must be -1 (output logprobs only) or a prompt position in [0, 1]",
        ),
        (json.dumps({"input_ids": [1, 2], "logprob_start_len": 0.5}).encode(), "logprob_start_len = 0.5"),
    ],
)
def test_bad_requests_get_a_400_json_error_and_the_server_keeps_serving(server, body, message):
    status, reply = post(server, "/generate", raw=body)
    assert status == 400 and message in reply["error"]["message"], reply
    assert reply["error"]["code"] == 400 and "\n" not in reply["error"]["message"]
    assert len(reply["error"]["message"]) < 300  # values are shown abridged
    assert len(generate(server, max_new_tokens=2)["output_ids"]) >= 1


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
NOT_INT = JSON.filter(lambda v: type(v) is not int)
IDS = st.lists(st.integers(-2, 700), max_size=5)
SAMPLING = st.fixed_dictionaries(
    {"max_new_tokens": st.integers(-1, 4) | st.integers(2000, 10**30) | NOT_INT},  # valid ones stay short
    optional={
        "temperature": st.floats() | st.floats(0, 1e-30) | st.integers() | JSON,
        "top_p": st.floats() | JSON,
        "top_k": st.integers() | JSON,
        "stop_token_ids": st.lists(st.integers()) | JSON,
        "ignore_eos": JSON,
        "n": JSON,
    },
)
BODIES = (
    st.fixed_dictionaries(
        {"input_ids": IDS | st.lists(IDS, max_size=3) | JSON, "sampling_params": SAMPLING | JSON},
        optional={
            "return_logprob": JSON,
            "stream": JSON,
            "rid": st.text(max_size=4) | JSON,
            "text": JSON,
            "logprob_start_len": st.integers(-2, 6) | JSON,
        },
    )
    | JSON
)


def test_fuzzed_generate_bodies_get_200_or_400_and_never_disturb_requests_in_flight(server, tiny_model_dir):
    bystanders, done = [], threading.Event()

    def keep_a_request_running():
        while not done.is_set():
            bystanders.append(generate(server, max_new_tokens=40, ignore_eos=True))

    thread = threading.Thread(target=keep_a_request_running)
    thread.start()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(body=BODIES)
    @example(body={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3, "temperature": 1e-40}})
    def one_request(body):
        status, reply = post(server, "/generate", body)
        assert status in (200, 400), (body, reply)
        if status == 400:
            assert reply["error"]["code"] == 400 and "\n" not in reply["error"]["message"]
        flags = [body.get(name, False) for name in ("return_logprob", "stream")] if isinstance(body, dict) else []
        assert status == 400 or all(type(flag) is bool for flag in flags), (body, reply)  # no truthy strings

    try:
        one_request()
    finally:
        done.set()
        thread.join(timeout=120)
    assert bystanders
    for reply in bystanders:
        assert reply["meta_info"]["finish_reason"]["type"] == "length"
        assert_teacher_forced(reply, tiny_model_dir)


def test_unknown_route_is_a_json_404_and_health_and_model_info_answer(server):
    assert post(server, "/no_such_route")[0] == 404
    with urllib.request.urlopen(f"http://{server}/health", timeout=30) as response:
        assert response.status == 200
    info = model_info(server)
    assert info["is_generation"] and info["context_length"] == 1024


def test_a_client_that_disconnects_frees_its_slot(server):
    request = urllib.request.Request(
        f"http://{server}/generate",
        method="POST",
        data=json.dumps(
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
        ).encode(),
    )
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(request, timeout=0.5)  # gives up and closes the connection
    # far sooner than the ~1000 decode steps the request would still need
    wait_for(
        lambda: (lambda info: (info["running_requests"], info["waiting_requests"]) == (0, 0))(model_info(server)),
        "the abandoned request to leave",
        timeout_s=10,
    )


def test_a_short_request_is_served_while_a_3000_prompt_call_runs_and_the_call_is_refused_past_the_limit(server):
    big = {"input_ids": [PROMPT] * 3000, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
    thread, out = in_background(post, server, "/generate", big)
    try:
        wait_for(lambda: model_info(server)["running_requests"] > 0, "the 3,000-prompt call to start")
        reply = generate(server, max_new_tokens=8, ignore_eos=True)
        assert len(reply["output_ids"]) == 8
        assert thread.is_alive() and model_info(server)["waiting_requests"] > 0  # the call still runs
    finally:
        assert post(server, "/abort_request", {"abort_all": True})[0] == 200
        thread.join(timeout=60)
    status, replies = out["result"]
    assert status == 200 and len(replies) == 3000
    assert {r["meta_info"]["finish_reason"]["type"] for r in replies} <= {"abort", "length"}

    status, error = post(server, "/generate", {"input_ids": [PROMPT] * 4097})
    assert status == 400
    assert "4097 prompts; one /generate call takes at most 4096" in error["error"]["message"]
    assert len(generate(server)["output_ids"]) == 8  # and the server serves on


def test_a_row_with_non_finite_logits_fails_alone(tiny_model_dir, tmp_path):
    """A token whose embedding is NaN poisons its own sequence only: that request is a 500, the requests
    decoding beside it and those later given its KV row are served as by the clean model."""
    poison = 400  # in no prompt below; generation stops at it (a sampled one would poison its sequence)
    model = load_model(tiny_model_dir)
    model.config.tie_word_embeddings = False  # so the NaN is in the input embedding only
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())
        model.model.embed_tokens.weight[poison].fill_(float("nan"))
    poisoned = save_model(model, load_tokenizer(tiny_model_dir), tmp_path / "poisoned")
    prompts = [PROMPT[: i + 1] for i in range(5)]
    with embedded_server(poisoned, tmp_path / "runs") as (_, address):
        with paused(address):
            workers = [
                in_background(generate, address, p, max_new_tokens=60, ignore_eos=True, stop_token_ids=[poison])
                for p in prompts
            ]
            wait_queued(address, 5, "five requests to wait in the paused server's queue")
        status, reply = post(
            address, "/generate", {"input_ids": PROMPT + [poison] * 30, "sampling_params": {"max_new_tokens": 3}}
        )
        assert status == 500 and "logits are not finite" in reply["error"]["message"], reply
        for prompt, (worker, out) in zip(prompts, workers):
            worker.join(timeout=120)
            assert_teacher_forced(out["result"], tiny_model_dir, prompt)
        # a long sequence in row 0, then short ones in rows 1-7 (the failed one's among them): they attend
        # over cache columns up to the long one's position, which the failed sequence wrote (masked, but a
        # masked NaN still reaches the output)
        with paused(address):
            long, out = in_background(
                generate, address, PROMPT * 8, max_new_tokens=60, ignore_eos=True, stop_token_ids=[poison]
            )
            wait_queued(address, 1, "the long request to wait in the paused server's queue")
        status, replies = post(
            address,
            "/generate",
            {
                "input_ids": [PROMPT] * 7,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "stop_token_ids": [poison]},
            },
        )
        assert status == 200, replies
        long.join(timeout=120)
        for prompt, reply in zip([PROMPT * 8] + [PROMPT] * 7, [out["result"], *replies]):
            assert_teacher_forced(reply, tiny_model_dir, prompt)
