"""Weight updates of the embedded server, all or nothing: from disk, from a trainer's broadcast in
buckets, and re-joining the update group after a trainer restart. The trainer's distributed sync: its
update group is set up as SGLang's ranks set up theirs (a stand-in SGLang server with two TP ranks,
each a process that joins exactly as SGLang's model runner does, shares the group with an embedded
server), and a push after a server was killed (SIGKILL) completes with the survivor.

Refused updates share one server and check that it still serves the weights and version it started
with; updates that succeed get a server of their own, so every test passes in any order.
"""

import asyncio
import contextlib
import json
import os
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from aiohttp import web
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from areal_hpc.models.chat import prompt_ids
from areal_hpc.models.hf import CheckpointError, load_model, load_tokenizer, read_checkpoint, save_model
from areal_hpc.parallel.weight_group import broadcast_tensor, host_store, join_update_group
from areal_hpc.rollout.client import RolloutClient
from areal_hpc.train.weight_push import DTYPE_NAMES, DistributedWeightSync
from tests.conftest import REPO, embedded_server
from tests.rollout.test_server import PROMPT, generate, in_background, model_info, post, wait_for
from tests.train.test_trainer import SAMPLING, assert_served_by, perturbed_engine
from tests.waiting import serve_on_loopback


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with embedded_server(tiny_model_dir, tmp_path_factory.mktemp("runs")) as (_, address):
        yield address


@pytest.fixture
def own_server(tiny_model_dir, tmp_path):
    """A server for one test that changes its weights."""
    with embedded_server(tiny_model_dir, tmp_path / "runs") as (process, address):
        yield process, address


def served(address: str) -> tuple[list[int], str]:
    """What a refused update must leave alone: greedy output and weight version."""
    return generate(address, temperature=0, max_new_tokens=8)["output_ids"], model_info(address)["weight_version"]


def peer_closed(message: str) -> bool:
    """Gloo's error when the other end closed the group: "closed" after an orderly shutdown, "reset" when
    the peer closed with data it had not read (TCP answers with RST); which one comes is a matter of timing."""
    return "Connection closed by peer" in message or "Connection reset by peer" in message


def perturbed(model_dir, seed: int):
    """The same architecture with other weights: what a training step produces."""
    model = load_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * param.std() * torch.randn(param.shape, generator=generator))
    return model


def greedy(model, n: int = 6) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False)[0, len(PROMPT) :].tolist()


def refused(address: str, route: str, body: dict) -> str:
    status, reply = post(address, route, body)
    assert status == 400, reply
    message = reply["error"]["message"]
    assert "\n" not in message
    return message


@contextlib.contextmanager
def trainer_group(address: str, group_name: str = "sync"):
    """Rank 0 of a new update group joined by the server (what a trainer does when it starts); on exit
    the trainer's side goes away, as when its process ends."""
    store = host_store("127.0.0.1", 2, timeout_s=60)
    joining, joined = in_background(join_update_group, "gloo", "127.0.0.1", store.port, 0, 2, group_name, 60, store)
    status, reply = post(
        address,
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": group_name,
            "backend": "gloo",
        },
    )
    joining.join(timeout=60)
    assert status == 200, reply
    group = joined.pop("result")
    try:
        yield group
    finally:
        group.close()


def push(address: str, group, tensors: dict[str, torch.Tensor], version: int, **declared) -> tuple[int, dict]:
    """One bucket as weight_push sends it: the request, and rank 0 broadcasting every tensor. The
    broadcasts must complete whatever the server answers (or the trainer would hang)."""
    body = {
        "names": list(tensors),
        "dtypes": [DTYPE_NAMES[t.dtype] for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "weight_version": version,
        **declared,
    }
    request, reply = in_background(post, address, "/update_weights_from_distributed", body)
    for tensor in tensors.values():
        broadcast_tensor(group, tensor.contiguous())
    request.join(timeout=60)
    return reply["result"]


def save(model, tiny_model_dir, folder):
    return save_model(model, load_tokenizer(tiny_model_dir), folder)


# -- refused updates (shared server, nothing may change) ---------------------------------------


def test_a_checkpoint_with_another_vocabulary_is_refused_and_changes_nothing(server, tiny_model_dir, tmp_path):
    before = served(server)
    model = perturbed(tiny_model_dir, seed=3)
    vocab = model.config.vocab_size
    model.resize_token_embeddings(vocab + 16)
    message = refused(
        server, "/update_weights_from_disk", {"model_path": str(save(model, tiny_model_dir, tmp_path / "m"))}
    )
    assert message == (
        f"weights not loaded (version 0 kept): model.embed_tokens.weight has shape [{vocab + 16}, 128]; "
        f"the served model's is [{vocab}, 128]"
    )
    assert served(server) == before


def test_a_checkpoint_with_fewer_layers_is_refused_and_changes_nothing(server, tiny_model_dir, tmp_path):
    before = served(server)
    model = perturbed(tiny_model_dir, seed=4)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers, model.config.layer_types = 2, model.config.layer_types[:2]
    message = refused(
        server,
        "/update_weights_from_disk",
        {"model_path": str(save(model, tiny_model_dir, tmp_path / "m")), "weight_version": 3},
    )
    assert message == (
        "weights not loaded (version 0 kept): model.layers.2.self_attn.q_proj.weight is missing "
        "(given 26 of the served model's 50 tensors) (and 23 more mismatches)"
    )
    assert served(server) == before


def test_a_checkpoint_with_an_untied_head_is_refused_and_changes_nothing(server, tiny_model_dir, tmp_path):
    before = served(server)
    model = perturbed(tiny_model_dir, seed=5)
    model.config.tie_word_embeddings = False
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight + 1)
    message = refused(
        server, "/update_weights_from_disk", {"model_path": str(save(model, tiny_model_dir, tmp_path / "m"))}
    )
    assert message.endswith(
        "model.embed_tokens.weight and lm_head.weight are one tied tensor in the served model but differ here"
    ), message
    assert served(server) == before


def test_unreadable_checkpoints_are_refused_with_the_whole_reason(server, tmp_path):
    before = served(server)
    assert refused(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "nowhere")}).endswith(
        "is not a folder"
    )
    assert refused(server, "/update_weights_from_disk", {"model_path": str(tmp_path)}).endswith(
        "has no model.safetensors or model.safetensors.index.json (the embedded engine loads safetensors checkpoints)"
    )
    (tmp_path / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{not a header")
    message = refused(server, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert message.startswith(f"could not read the checkpoint in {tmp_path}: SafetensorError: "), message
    assert served(server) == before


@pytest.mark.parametrize(
    "mismatch, message",
    [
        (
            "model.layers.0.mlp.up.weight",
            "model.layers.0.mlp.up.weight is not a tensor of the served model "
            "(nearest: model.layers.0.mlp.up_proj.weight)",
        ),
        ("model.norm.weight", "model.norm.weight has shape [129]; the served model's is [128]"),
    ],
)
def test_a_bucket_that_does_not_fit_is_received_then_refused_and_changes_nothing(
    server, tiny_model_dir, mismatch, message
):
    before = served(server)
    state = perturbed(tiny_model_dir, seed=6).state_dict()
    bucket = {name: state[name] for name in list(state)[:12]}  # these would change the output ...
    bucket[mismatch] = torch.ones(129)  # ... but the last tensor does not fit
    with trainer_group(server) as group:
        status, reply = push(server, group, bucket, version=9)
    assert status == 400 and reply["error"]["message"] == f"weights not loaded (version 0 kept): {message}", reply
    assert served(server) == before


def test_a_bucket_that_cannot_be_received_closes_the_group_so_the_trainer_fails_fast(server, tiny_model_dir):
    before = served(server)
    with trainer_group(server) as group:
        body = {"names": ["model.norm.weight"], "dtypes": ["float8"], "shapes": [[128]]}

        def refused_broadcast():
            with pytest.raises(RuntimeError) as refusal:
                broadcast_tensor(group, torch.ones(128))
            return refusal

        sending, sent = in_background(refused_broadcast)
        message = refused(server, "/update_weights_from_distributed", body)
        sending.join(timeout=30)  # the group's timeout is 60 s: only a closed connection ends it sooner
        assert not sending.is_alive() and peer_closed(str(sent["result"].value))
    assert message == (
        "model.norm.weight: dtype 'float8' is not one of ['bfloat16', 'float16', 'float32']; "
        "the update group is closed (call /init_weights_update_group again)"
    )
    assert refused(server, "/update_weights_from_distributed", body) == "call /init_weights_update_group first"
    assert served(server) == before


@pytest.mark.parametrize(
    "body, message",
    [
        ({"master_port": "29500"}, "master_port = '29500'; it must be an integer in [1, 65535]"),
        ({"rank_offset": 0}, "rank_offset = 0; it must be an integer in [1, world_size)"),
        ({"rank_offset": 2}, "rank_offset = 2; it must be an integer in [1, world_size)"),
        ({"world_size": True}, "world_size = True; it must be an integer >= 2"),
        ({"backend": "mpi"}, "backend = 'mpi'; it must be 'gloo' or 'nccl'"),
    ],
)
def test_bad_update_group_requests_are_refused_before_joining(server, body, message):
    good = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    assert refused(server, "/init_weights_update_group", {**good, **body}) == message


# -- updates that apply (a server each) ---------------------------------------------------------


def test_weight_update_from_disk_changes_outputs_and_version_tags(own_server, tiny_model_dir, tmp_path):
    _, address = own_server
    source = perturbed(tiny_model_dir, seed=1)
    status, reply = post(
        address,
        "/update_weights_from_disk",
        {"model_path": str(save(source, tiny_model_dir, tmp_path / "m")), "weight_version": "5"},
    )
    assert status == 200 and reply["weight_version"] == "5", reply
    after = generate(address, temperature=0, max_new_tokens=6)
    assert after["output_ids"] == greedy(source)[: len(after["output_ids"])]
    assert after["meta_info"]["output_token_versions"] == [5] * len(after["output_ids"])


def test_weight_update_from_distributed_in_buckets_with_half_precision_cast(own_server, tiny_model_dir):
    """The trainer's buckets, lm_head (tied) included; a bucket declared float16 is cast to float32."""
    _, address = own_server
    source = perturbed(tiny_model_dir, seed=2)
    with torch.no_grad():
        for param in source.parameters():
            param.copy_(param.half().float())  # so sending in float16 loses nothing
    state = source.state_dict()
    names = list(state)
    with trainer_group(address) as group:
        assert push(address, group, {n: state[n] for n in names[:25]}, version=7)[0] == 200
        status, reply = push(address, group, {n: state[n].half() for n in names[25:]}, version=7)
    assert status == 200 and reply["weight_version"] == "7", reply
    out = generate(address, temperature=0, max_new_tokens=6)
    assert out["output_ids"] == greedy(source)[: len(out["output_ids"])]
    assert set(out["meta_info"]["output_token_versions"]) == {7}


def test_a_restarted_trainer_joins_again_while_the_old_one_hangs_and_nothing_leaks(own_server, tiny_model_dir):
    """A trainer stops mid-update (its bucket declared, nothing sent): the server keeps generating, a
    restarted trainer joins a new group and updates through it; when the old trainer's process ends
    its update fails. Restarting three times leaves the server with the files and threads of one group."""
    process, address = own_server
    http_port = int(address.rsplit(":", 1)[1])

    def resources():
        """The server's open files and threads, less the connections of HTTP requests: the server closes
        its end of a finished request's connection in its own time (after the reply the test reads)."""
        http = http_connections(process.pid, http_port)
        fds = [
            fd
            for fd in os.listdir(f"/proc/{process.pid}/fd")
            if (link := _link(f"/proc/{process.pid}/fd/{fd}")) and link not in http
        ]
        return len(fds), len(os.listdir(f"/proc/{process.pid}/task"))

    with trainer_group(address):  # the old trainer: it declares a bucket and sends nothing
        hung, hung_reply = in_background(
            post,
            address,
            "/update_weights_from_distributed",
            {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]], "weight_version": 1},
        )
        answer, reply = in_background(generate, address, max_new_tokens=4)
        answer.join(timeout=30)
        assert len(reply["result"]["output_ids"]) == 4  # generation does not wait for the hung update
        held = []
        for restart in range(3):
            source = perturbed(tiny_model_dir, seed=10 + restart)
            with trainer_group(address) as new:
                status, update = push(address, new, source.state_dict(), version=10 + restart)
                assert status == 200, update
                assert generate(address, temperature=0, max_new_tokens=6)["output_ids"] == greedy(source)[:6]
                held.append(resources())  # the hung update's group and this one
        assert "result" not in hung_reply
        assert held[-1] == held[0], held
    hung.join(timeout=30)  # the old trainer is gone: its connection closed, the transfer fails now
    status, update = hung_reply["result"]
    assert status == 500 and peer_closed(update["error"]["message"]), update
    assert model_info(address)["weight_version"] == "12"
    assert wait_for(
        lambda: resources() < held[0],
        "the hung update's group to be freed",
        seen=lambda: f"(files, threads) {resources()}, with both groups {held[0]}",
    )


def http_connections(pid: int, port: int) -> set[str]:
    """The ``socket:[inode]`` links of ``pid``'s TCP connections accepted on ``port`` (not its listener)."""
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as listing:
                lines = listing.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port, state, inode = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]
            if local_port == port and state != "0A":  # 0A: LISTEN
                found.add(f"socket:[{inode}]")
    return found


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile
        return ""


# -- the trainer's side: SGLang's group conventions, a server killed between pushes ---------------

SGLANG_TP_RANK = """
import datetime, json, sys, torch, torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

# One TP rank of an SGLang server joining an update group, as sglang's ModelRunner.init_weights_update_group
# (model_executor/model_runner.py) and init_custom_process_group (utils/common.py) do it: rank
# rank_offset + tp_rank, torch's tcp:// rendezvous, PrefixStore(group_name), torch's group helper.
invite, tp_rank = json.loads(sys.argv[1]), int(sys.argv[2])
timeout = datetime.timedelta(seconds=60)
url = f"tcp://{invite['master_address']}:{invite['master_port']}"
store, rank, world = next(rendezvous(url, invite["rank_offset"] + tp_rank, invite["world_size"], timeout=timeout))
name = invite["group_name"]
group, _ = _new_process_group_helper(world, rank, [], Backend(invite["backend"]), PrefixStore(name, store),
                                     group_name=name, timeout=timeout)
_world.pg_group_ranks[group] = {i: i for i in range(world)}
print("joined", flush=True)
for line in sys.stdin:  # one bucket a line: receive it as update_weights_from_distributed does, report sums
    bucket = json.loads(line)
    tensors = [torch.empty(shape, dtype=getattr(torch, dtype))
               for dtype, shape in zip(bucket["dtypes"], bucket["shapes"])]
    for tensor in tensors:
        dist.broadcast(tensor, src=0, group=group)
    print(json.dumps({n: t.double().sum().item() for n, t in zip(bucket["names"], tensors)}), flush=True)
"""


@contextlib.asynccontextmanager
async def sglang_server_with_two_tp_ranks():
    """SGLang's HTTP side of a distributed update, its TP ranks real processes; records what it is sent."""
    seen, ranks = {"invites": [], "buckets": [], "received": [{}, {}]}, []

    async def init_weights_update_group(request):
        invite = await request.json()
        seen["invites"].append(invite)
        for tp_rank in range(2):
            ranks.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-c",
                    SGLANG_TP_RANK,
                    json.dumps(invite),
                    str(tp_rank),
                    cwd=REPO,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                )
            )
        assert [await rank.stdout.readline() for rank in ranks] == [b"joined\n"] * 2
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weights_from_distributed(request):
        bucket = await request.json()
        seen["buckets"].append(bucket)
        for rank in ranks:
            rank.stdin.write(json.dumps(bucket).encode() + b"\n")
        for received, rank in zip(seen["received"], ranks):
            received.update(json.loads(await rank.stdout.readline()))
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def health(request):
        return web.json_response({})

    async def server_info(request):
        return web.json_response({"tp_size": 2, "dp_size": 1})

    app = web.Application()
    app.add_routes(
        [
            web.get("/health", health),
            web.get("/get_server_info", server_info),
            web.post("/init_weights_update_group", init_weights_update_group),
            web.post("/update_weights_from_distributed", update_weights_from_distributed),
        ]
    )
    async with serve_on_loopback(app) as address:
        try:
            yield address, seen
        finally:
            for rank in ranks:
                if rank.returncode is None:
                    rank.kill()
                await rank.wait()


def test_the_update_group_is_set_up_as_sglang_sets_it_up_one_rank_per_tp_rank(own_server, tiny_model_dir):
    _, embedded = own_server
    engine = perturbed_engine(tiny_model_dir)

    async def run():
        async with sglang_server_with_two_tp_ranks() as (sglang, seen), RolloutClient([embedded, sglang]) as client:
            sync = DistributedWeightSync("gloo", 1 << 16)
            await sync.connect(client)  # the embedded server is rank 1, SGLang's TP ranks 2 and 3
            name = seen["invites"][0]["group_name"]
            keys = [f"{name}/{name}//cpu//0/{rank}" for rank in range(4)]  # "<group>/" twice, then the device
            assert sync.group.store.check(keys), keys
            await sync.push(engine, client, version=5)
            client.drop(sglang, "the stand-in does not generate")
            generation = await client.generate(prompt_ids(engine.tokenizer, "What is 3 + 4?"), SAMPLING)
            sync.destroy_group()
            return seen, generation

    seen, generation = asyncio.run(run())
    invite = seen["invites"][0]
    assert invite == {
        "master_address": "127.0.0.1",
        "master_port": invite["master_port"],
        "rank_offset": 2,
        "world_size": 4,
        "backend": "gloo",
        "group_name": invite["group_name"],
    }
    fields = {"names", "dtypes", "shapes", "group_name", "weight_version"}  # SGLang's, its own defaults aside
    assert all(bucket.keys() == fields for bucket in seen["buckets"])
    assert {(b["group_name"], b["weight_version"]) for b in seen["buckets"]} == {(invite["group_name"], "5")}
    sums = {name: tensor.double().sum().item() for name, tensor in engine.model.state_dict().items()}
    assert seen["received"][0] == seen["received"][1] == pytest.approx(sums)  # both TP ranks got every tensor
    assert_served_by(engine, generation, 5)


def test_a_push_after_a_server_was_killed_completes_and_reaches_the_survivor(tiny_model_dir, tmp_path):
    first, second = perturbed_engine(tiny_model_dir, seed=1), perturbed_engine(tiny_model_dir, seed=2)

    async def run(survivor, victim, kill):
        async with RolloutClient([survivor, victim]) as client:
            sync = DistributedWeightSync("gloo", 1 << 16)
            await sync.connect(client)
            await sync.push(first, client, version=1)
            kill()
            started = time.monotonic()
            await asyncio.wait_for(sync.push(second, client, version=2), timeout=120)
            took = time.monotonic() - started
            members, alive = list(sync.members), list(client.alive)
            generation = await client.generate(prompt_ids(second.tokenizer, "What is 3 + 4?"), SAMPLING)
            sync.destroy_group()
            return took, members, alive, generation

    with (
        embedded_server(tiny_model_dir, tmp_path / "a") as (_, survivor),
        embedded_server(tiny_model_dir, tmp_path / "b") as (victim_process, victim),
    ):

        def kill():
            victim_process.kill()
            victim_process.wait()

        took, members, alive, generation = asyncio.run(run(survivor, victim, kill))
    assert took < 30, took  # the group's own timeout, what a hang would cost, is 300 s
    assert members == alive == [survivor]
    assert_served_by(second, generation, 2)


def test_a_mixture_of_experts_checkpoint_reads_as_the_model_holds_it(tmp_path):
    """save_pretrained stores each expert's projections apart; servers and trainers read them stacked
    as the model holds them, and a checkpoint missing one expert tensor is refused by name."""
    config = Qwen3MoeConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(tmp_path / "moe")
    state, live = read_checkpoint(tmp_path / "moe"), model.state_dict()
    assert state.keys() == live.keys() and all(torch.equal(state[name], live[name]) for name in live)
    stored = load_file(tmp_path / "moe" / "model.safetensors")
    del stored["model.layers.1.mlp.experts.2.up_proj.weight"]
    (tmp_path / "broken").mkdir()
    save_file(stored, tmp_path / "broken" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lacks model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight \(and 0 more"):
        read_checkpoint(tmp_path / "broken")


def test_a_checkpoint_with_nan_weights_is_refused_and_changes_nothing(server, tiny_model_dir, tmp_path):
    before = served(server)
    model = perturbed(tiny_model_dir, seed=7)
    with torch.no_grad():
        model.model.norm.weight[:3] = torch.tensor([float("nan"), float("inf"), 1.0])
    message = refused(
        server, "/update_weights_from_disk", {"model_path": str(save(model, tiny_model_dir, tmp_path / "m"))}
    )
    assert message == (
        "weights not loaded (version 0 kept): model.norm.weight holds 2 NaN or infinite values; weights must be finite"
    )
    assert served(server) == before


def test_health_is_503_while_generation_fails_and_200_once_it_generates_again(tiny_model_dir):
    """Weights that went bad under a running server (injected on the engine thread, as no update can now
    bring them): /health says so instead of 200, and recovers with the weights."""
    from areal_hpc.rollout.embedded_engine import EmbeddedGenerator
    from areal_hpc.rollout.server import build_app
    from tests.proxy_helpers import serving

    engine = EmbeddedGenerator(load_model(tiny_model_dir), slots=2, context_length=128)
    good = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}

    def set_weights(fill: float | None) -> None:
        with torch.no_grad():
            for name, tensor in engine.model.state_dict().items():
                tensor.copy_(good[name] if fill is None else torch.full_like(tensor, fill))
        engine.decoder.refresh_weights()

    def health(address: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{address}/health", timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    try:
        with serving(build_app(engine, str(tiny_model_dir))) as (base, _):
            address = base.removeprefix("http://")
            assert health(base) == (200, {"status": "ok"})
            engine.call(lambda: set_weights(float("nan"))).result(timeout=60)
            status, reply = post(address, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
            assert status == 500 and "not finite" in reply["error"]["message"], reply
            status, reply = health(base)
            assert status == 503 and reply["status"] == "failing" and "not finite" in reply["error"], reply
            engine.call(lambda: set_weights(None)).result(timeout=60)
            assert generate(address)["meta_info"]["finish_reason"]["type"] == "length"
            assert health(base) == (200, {"status": "ok"})
    finally:
        engine.stop()
