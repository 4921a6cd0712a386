"""The embedded rollout server on loopback: SGLang's routes, logprob parity, pause/abort, weight updates."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from areal_hpc.models.hf import load_model, load_tokenizer, save_model
from areal_hpc.parallel.weight_group import broadcast_tensor, join_update_group
from tests.conftest import embedded_server

PROMPT = [5, 17, 33, 2, 9]


def post(address: str, route: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body or {}).encode()
    request = urllib.request.Request(f"http://{address}{route}", data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def generate(address: str, prompt=PROMPT, **sampling) -> dict:
    status, reply = post(address, "/generate", {"input_ids": prompt, "return_logprob": True,
                                                "sampling_params": {"max_new_tokens": 8, **sampling}})
    assert status == 200, reply
    return reply


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with embedded_server(tiny_model_dir, tmp_path_factory.mktemp("runs")) as (_, address):
        yield address


def perturbed_copy(model_dir, out, seed: int):
    """The same architecture and tokenizer with other weights: what a training step produces."""
    model = load_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * param.std() * torch.randn(param.shape, generator=generator))
    return save_model(model, load_tokenizer(model_dir), out), model


def teacher_forced_logprobs(model_dir, prompt, output) -> torch.Tensor:
    model = load_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def test_generate_returns_sglang_shape_with_logprobs_equal_to_a_teacher_forced_pass(server, tiny_model_dir):
    reply = generate(server, max_new_tokens=12, temperature=1.0, ignore_eos=True)
    meta = reply["meta_info"]
    assert len(reply["output_ids"]) == meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12} and meta["prompt_tokens"] == len(PROMPT)
    assert [entry[1] for entry in meta["output_token_logprobs"]] == reply["output_ids"]
    assert meta["output_token_versions"] == [0] * 12 and isinstance(reply["text"], str)
    served = torch.tensor([entry[0] for entry in meta["output_token_logprobs"]])
    expected = teacher_forced_logprobs(tiny_model_dir, PROMPT, reply["output_ids"])
    assert torch.allclose(served, expected, atol=1e-4), (served - expected).abs().max()


def test_batched_prompts_stop_tokens_and_greedy_determinism(server):
    greedy = generate(server, temperature=0)
    again = generate(server, temperature=0)
    assert greedy["output_ids"] == again["output_ids"]
    first = greedy["output_ids"][0]
    stopped = generate(server, temperature=0, stop_token_ids=[first])
    assert stopped["output_ids"] == [first]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    status, replies = post(server, "/generate", {"input_ids": [PROMPT, PROMPT[:2]], "rid": ["a", "b"],
                                                 "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert status == 200 and [r["meta_info"]["id"] for r in replies] == ["a", "b"]
    assert replies[0]["output_ids"] == greedy["output_ids"][:3]


def test_pause_returns_partial_outputs_and_queues_new_work_until_continue(server):
    results = {}

    def long_request(name):
        results[name] = generate(server, max_new_tokens=900, ignore_eos=True)

    running = threading.Thread(target=long_request, args=("running",))
    running.start()
    time.sleep(0.3)  # admitted within milliseconds; 900 tokens take seconds
    try:
        assert post(server, "/pause_generation", {"mode": "abort"}) == (200, {"success": True})
        running.join(timeout=60)
        partial = results["running"]
        assert partial["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(partial["output_ids"]) < 900
        queued = threading.Thread(target=lambda: results.update(queued=generate(server, max_new_tokens=4)))
        queued.start()
        time.sleep(0.5)
        assert "queued" not in results  # held while paused
    finally:  # the server is shared by the module's tests: never leave it paused
        assert post(server, "/continue_generation")[0] == 200
    queued.join(timeout=60)
    assert len(results["queued"]["output_ids"]) >= 1


def test_abort_request_by_id(server):
    results = {}
    worker = threading.Thread(target=lambda: results.update(r=post(server, "/generate", {
        "input_ids": PROMPT, "rid": "victim", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}})))
    worker.start()
    time.sleep(0.5)
    assert post(server, "/abort_request", {"rid": "victim"})[0] == 200
    worker.join(timeout=60)
    assert results["r"][1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_weight_update_from_disk_changes_outputs_and_version_tags(server, tiny_model_dir, tmp_path):
    before = generate(server, temperature=0)["output_ids"]
    other, _ = perturbed_copy(tiny_model_dir, tmp_path / "other", seed=1)
    status, reply = post(server, "/update_weights_from_disk", {"model_path": str(other), "weight_version": 5})
    assert status == 200 and reply["weight_version"] == "5", reply
    after = generate(server, temperature=0)
    assert after["output_ids"] != before
    assert after["meta_info"]["output_token_versions"] == [5] * len(after["output_ids"])
    assert post(server, "/update_weights_from_disk", {"model_path": str(tmp_path)})[0] == 400


def test_weight_update_from_distributed_broadcast(server, tiny_model_dir, tmp_path, unused_tcp_port=29517):
    _, source = perturbed_copy(tiny_model_dir, tmp_path / "source", seed=2)
    joined = {}
    rank0 = threading.Thread(target=lambda: joined.update(group=join_update_group(
        "gloo", "127.0.0.1", unused_tcp_port, 0, 2, "sync", timeout_s=60)))
    rank0.start()
    status, _ = post(server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": unused_tcp_port, "rank_offset": 1, "world_size": 2,
        "group_name": "sync", "backend": "gloo"})
    rank0.join(timeout=60)
    assert status == 200
    state = source.state_dict()
    names = [n for n in state if n != "lm_head.weight"]  # tied to the embedding
    reply = {}
    update = threading.Thread(target=lambda: reply.update(r=post(server, "/update_weights_from_distributed", {
        "names": names, "dtypes": ["float32"] * len(names), "shapes": [list(state[n].shape) for n in names],
        "group_name": "sync", "weight_version": 7})))
    update.start()
    for name in names:
        broadcast_tensor(joined["group"], state[name].contiguous())
    update.join(timeout=60)
    assert reply["r"][0] == 200
    out = generate(server, temperature=0, max_new_tokens=6)
    with torch.no_grad():
        expected = source.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)[0, len(PROMPT):]
    assert out["output_ids"] == expected.tolist()[:len(out["output_ids"])]
    assert set(out["meta_info"]["output_token_versions"]) == {7}


@pytest.mark.parametrize("body, message", [
    (b"{not json", "body is not valid JSON"),
    (b"[1, 2]", "body must be a JSON object"),
    (json.dumps({"input_ids": "hello"}).encode(), "input_ids must be a list of non-negative integers"),
    (json.dumps({"input_ids": [1], "sampling_params": {"temperature": "hot"}}).encode(),
     "sampling_params.temperature = 'hot'; it must be a number >= 0"),
    (json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}}).encode(),
     "too many tokens: 1 prompt + 5000 max_new_tokens > context length 1024"),
    (json.dumps({"input_ids": [10 ** 6]}).encode(), "the vocabulary has"),
    (json.dumps({"input_ids": [1], "sampling_params": {"best_of": 2}}).encode(), "unknown sampling_params ['best_of']"),
    (json.dumps({"input_ids": [1], "lora_path": "x"}).encode(), "unknown fields ['lora_path']"),
])
def test_bad_requests_get_a_400_json_error_and_the_server_keeps_serving(server, body, message):
    status, reply = post(server, "/generate", raw=body)
    assert status == 400 and message in reply["error"]["message"], reply
    assert len(generate(server, max_new_tokens=2)["output_ids"]) >= 1


def test_unknown_route_is_a_json_404_and_health_and_model_info_answer(server):
    assert post(server, "/no_such_route")[0] == 404
    with urllib.request.urlopen(f"http://{server}/health", timeout=30) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"http://{server}/get_model_info", timeout=30) as response:
        info = json.loads(response.read())
    assert info["is_generation"] and info["context_length"] == 1024


def test_a_client_that_disconnects_frees_its_slot(server):
    request = urllib.request.Request(f"http://{server}/generate", method="POST", data=json.dumps(
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}).encode())
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(request, timeout=0.5)  # gives up and closes the connection
    time.sleep(0.3)  # far less than the ~1000 decode steps the request would still need
    with urllib.request.urlopen(f"http://{server}/get_model_info", timeout=30) as response:
        info = json.loads(response.read())
    assert (info["running_requests"], info["waiting_requests"]) == (0, 0)


def test_an_engine_failure_is_a_500_and_the_server_recovers(server, tiny_model_dir, tmp_path):
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))  # tied: every logit becomes NaN, sampling fails
    broken = save_model(model, load_tokenizer(tiny_model_dir), tmp_path / "broken")
    assert post(server, "/update_weights_from_disk", {"model_path": str(broken)})[0] == 200
    status, reply = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
    assert status == 500 and "failed in the engine" in reply["error"]["message"]
    assert post(server, "/update_weights_from_disk", {"model_path": str(tiny_model_dir), "weight_version": 0})[0] == 200
    assert len(generate(server, max_new_tokens=3)["output_ids"]) == 3
