"""The torch engine built from a checkpoint as the Hub ships it (bf16 safetensors shards and their index): on the
meta device, each rank then reading only the slices it keeps (``engines.torch.rank_weights``), into float32
parameters equal to transformers' own loading of the folder; a rank reads exactly what it holds."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import PolicyOutputs, ValueOutputs
from areal_hpc.models.hf import load_critic, model_skeleton
from areal_hpc.models.hub_checkpoint import HubCheckpoint
from tests.conftest import small_llama
from tests.models.test_hub_checkpoint import hub_form
from tests.trainer_processes import run_ranks


@pytest.fixture(scope="module")
def hub_llama(tmp_path_factory):
    return hub_form(small_llama(256, 16384, 8192, tied=False), tmp_path_factory.mktemp("hub") / "llama")


def test_one_process_reads_the_shards_as_transformers_loads_them(hub_llama, tiny_model_dir):
    checkpoint = HubCheckpoint(hub_llama)
    engine = TorchTrainEngine.on_checkpoint(
        model_skeleton(checkpoint), checkpoint, PolicyOutputs(), torch.device("cpu")
    )
    plain = AutoModelForCausalLM.from_pretrained(hub_llama, dtype=torch.float32)
    ours = {**dict(engine.model.named_buffers()), **engine.model.state_dict()}
    want = {**dict(plain.named_buffers()), **plain.state_dict()}  # rotary frequencies included
    assert ours.keys() == want.keys() and all(torch.equal(ours[k], want[k]) for k in want)
    assert checkpoint.bytes_read == sum(t.numel() * 2 for t in plain.state_dict().values())  # each tensor once

    torch.manual_seed(0)  # a critic from the policy's folder: the fresh head load_critic draws after that seed
    critic = model_skeleton(HubCheckpoint(tiny_model_dir), critic=True)
    torch.manual_seed(0)
    for name, tensor in load_critic(tiny_model_dir).score.state_dict().items():
        assert torch.equal(critic.score.state_dict()[name], tensor), name
    TorchTrainEngine.on_checkpoint(critic, HubCheckpoint(tiny_model_dir), ValueOutputs(), torch.device("cpu"))


@pytest.mark.distributed
def test_pp2_fsdp2_ranks_read_their_slices_only(hub_llama, tmp_path):
    got = run_ranks(4, hub_llama, tmp_path / "out.pt", "pp=2", "dp=2", "fsdp=1", "read=1", module="tests.native_ranks")
    plain = AutoModelForCausalLM.from_pretrained(hub_llama, dtype=torch.float32).state_dict()
    assert got["weights"].keys() == plain.keys()
    assert all(torch.equal(got["weights"][name], plain[name]) for name in plain)  # bf16 on disk, float32 held
    for rank in got["ranks"]:  # bf16 bytes read: exactly the slices the rank holds, nothing more
        assert rank["read"] == 2 * rank["held_elements"] > 0
    assert sum(rank["held_elements"] for rank in got["ranks"]) == sum(t.numel() for t in plain.values())
