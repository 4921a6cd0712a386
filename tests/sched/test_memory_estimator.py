"""The memory estimator (``areal_hpc.sched.memory``) against measured training steps, by hand for a
Qwen2.5-1.5B shape, and ``areal-hpc submit --check-memory`` refusing a layout that cannot fit.

What is measured: the torch engine takes real optimizer steps on CPU (a 4.1M-parameter Qwen2, the "small"
preset's shape, with a 672-token vocabulary) and ``LiveTensorBytes`` records the peak of the bytes held by
every live tensor storage during the second step: the parameters, the optimizer states and any gradients
there before it, plus every tensor an operator creates during it (forward, backward, optimizer), each
counted until its storage is freed or resized (FSDP frees gathered parameters by resizing their storage
to 0). That is the memory the estimator models (tensors), not the process's RSS, whose interpreter,
libraries and allocator caches are what the device reserve stands for. Layouts: one process in float32;
one process with bfloat16 autocast and twice the tokens; two gloo ranks with FSDP. Activations are more
than half of each peak, so their formula is what the 20% bound tests.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from areal_hpc.layout import ParallelDims
from areal_hpc.sched.memory import (
    GB,
    Precision,
    TrainLayout,
    kv_bytes_per_slot,
    largest_micro_tokens,
    rollout_estimate,
    train_estimate,
    usable_bytes,
)
from areal_hpc.sched.model_spec import load_model_spec
from tests.conftest import run_cli

VOCAB = 672  # the tiny tokenizer's size
LOGITS_CHUNK_ROWS = 128 * 2**20 // (4 * VOCAB)  # the torch engine's chunked log-softmax: all rows at once here
LAYOUTS = {  # name: (data-parallel ranks with FSDP, compute dtype, tokens per micro-batch)
    "float32": (1, "float32", 1024),
    "bfloat16 autocast": (1, "bfloat16", 2048),
    "fsdp dp=2": (2, "float32", 1024),
}


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages alive while it is active: ``initial`` ones, and every one an
    operator returns (a DTensor's local shard). Storages are held weakly and re-read at every operator,
    so a freed or resized one stops counting at once."""

    def __init__(self, initial: list[torch.Tensor]):
        super().__init__()
        self.live: dict[int, StorageWeakRef] = {}
        self.peak = 0
        for tensor in initial:
            self._add(tensor)
        self._measure()

    def _add(self, tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        known = self.live.get(storage._cdata)
        if known is None or known.expired():
            self.live[storage._cdata] = StorageWeakRef(storage)

    def _measure(self) -> None:
        for key in [key for key, ref in self.live.items() if ref.expired()]:
            del self.live[key]
        now = sum(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes() for ref in self.live.values())
        self.peak = max(self.peak, now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            self._add(tensor)
        self._measure()
        return out


def held_tensors(engine) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer states the engine holds between steps."""
    held = [*engine.model.parameters(), *engine.model.buffers()]
    held += [p.grad for p in engine.model.parameters() if p.grad is not None]
    held += [v for state in engine.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return held


def small_qwen2(folder):
    """The "small" preset's Qwen2 at the tiny tokenizer's vocabulary, its config.json written to ``folder``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_hpc.models.tiny import PRESETS

    config = Qwen2Config(**PRESETS["small"], vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=4096)
    config.save_pretrained(folder)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def measured_peak(folder, compute_dtype: str, tokens: int, mesh=None) -> int:
    """Peak tensor bytes of this rank during its second training step (the first creates Adam's states)."""
    from areal_hpc.config import OptimizerConfig
    from areal_hpc.engines.sequence_batch import SequenceBatch
    from areal_hpc.engines.torch.engine import TorchTrainEngine
    from areal_hpc.engines.torch.outputs import packed_policy_outputs

    engine = TorchTrainEngine(
        small_qwen2(folder),
        packed_policy_outputs,
        mesh=mesh,
        optimizer=OptimizerConfig(),
        lr=1e-4,
        max_tokens_per_mb=tokens,
        compute_dtype=compute_dtype,
    )
    generator = torch.Generator().manual_seed(0)
    length, count = tokens // 4, 4  # four sequences filling one micro-batch
    sequences = [torch.randint(3, VOCAB, (length,), generator=generator).tolist() for _ in range(count)]
    masks = [[0] * 8 + [1] * (length - 8) for _ in range(count)]
    batch = SequenceBatch(sequences, masks, {"weights": [torch.full((length,), 1 / tokens)] * count})

    def loss_fn(outputs, packed, fields):
        return -(outputs["logprobs"] * fields["weights"]).sum(), {}

    engine.train_step(batch, loss_fn)
    with LiveTensorBytes(held_tensors(engine)) as live:
        engine.train_step(batch, loss_fn)
    return live.peak


def fsdp_rank(rank: int, port: int, folder: str, out: str) -> None:
    from areal_hpc.parallel.mesh import build_mesh, close_distributed, init_distributed

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))
    mesh = build_mesh(ParallelDims(dp=2, fsdp=True), torch.device("cpu"))
    _, compute_dtype, tokens = LAYOUTS["fsdp dp=2"]
    peak = measured_peak(folder, compute_dtype, tokens, mesh)
    with open(f"{out}.{rank}", "w") as file:
        json.dump(peak, file)
    close_distributed()


@pytest.mark.parametrize("name", LAYOUTS)
def test_estimate_is_within_20_percent_of_the_measured_peak(name, tmp_path):
    from areal_hpc.runtime.name_resolve import free_port

    dp, compute_dtype, tokens = LAYOUTS[name]
    if dp == 1:
        peak = measured_peak(tmp_path, compute_dtype, tokens)
    else:
        mp.spawn(fsdp_rank, args=(free_port("127.0.0.1"), str(tmp_path), str(tmp_path / "peak")), nprocs=dp)
        peak = max(json.loads((tmp_path / f"peak.{rank}").read_text()) for rank in range(dp))
    layout = TrainLayout(
        ParallelDims(dp=dp, fsdp=dp > 1),
        Precision("float32", compute_dtype, "float32"),
        tokens,
        logit_tokens=LOGITS_CHUNK_ROWS,
        vocab_parallel=False,
    )
    estimate = train_estimate(load_model_spec(str(tmp_path)), layout)
    print(
        f"{name}: estimated {estimate.total / 2**20:.1f} MiB, measured {peak / 2**20:.1f} MiB "
        f"({estimate.total / peak:.2f}x); {estimate.describe()}"
    )
    assert estimate.activations > estimate.total / 2  # the activation formula carries the bound
    assert estimate.total == pytest.approx(peak, rel=0.20)


QWEN_1_5B = load_model_spec("r1-distill-qwen-1.5b")  # Qwen2.5-1.5B's shape


def test_qwen_1_5b_by_hand():
    """h 1536, 28 layers, 12 heads of 128, 2 KV heads, MLP 8960, vocabulary 151,936, untied."""
    h, layers, q, kv, i, vocab = 1536, 28, 1536, 256, 8960, 151936
    per_layer = h * (q + 2 * kv) + q + 2 * kv + q * h + 3 * h * i + 2 * h
    params = layers * per_layer + 2 * vocab * h + h
    assert QWEN_1_5B.params == params == 1_777_088_000
    # Megatron's mixed precision, dp 4 x tp 2, distributed optimizer, 8192 tokens, full recomputation
    layout = TrainLayout(
        ParallelDims(dp=4, tp=2),
        Precision("bfloat16", "bfloat16", "float32"),
        8192,
        recompute="full",
        shard_optimizer=True,
    )
    estimate = train_estimate(QWEN_1_5B, layout)
    rank_params = layers * per_layer / 2 + 2 * vocab * h / 2 + h
    assert estimate.params == pytest.approx(2 * rank_params)
    assert estimate.grads == pytest.approx(4 * rank_params)
    assert estimate.optimizer == pytest.approx(12 * rank_params / 4)  # master weights and 2 moments, over dp
    one_layer = 8192 * (4 * h * 2 + (4 * q / 2 + 3 * kv / 2) * 2 + (kv / 2 + q / 2 + 4 * i / 2 + 2 * h) * 2)
    inputs = layers * 8192 * h * 2
    logits = 8192 * vocab / 2 * (4 + 2)
    assert estimate.activations == pytest.approx(inputs + one_layer + logits)
    # torch engine, one process: float32 weights, bfloat16 autocast (a bfloat16 copy of every weight)
    torch_layout = TrainLayout(
        ParallelDims(), Precision("float32", "bfloat16", "float32"), 4096, logit_tokens=4096, vocab_parallel=False
    )
    eager = train_estimate(QWEN_1_5B, torch_layout)
    assert (eager.params, eager.grads, eager.optimizer) == pytest.approx((4 * params, 4 * params, 8 * params))
    wide = 4 * h + 4 * q + 3 * kv
    narrow = kv + q + 4 * i + 5 * h
    assert eager.activations == pytest.approx(layers * 4096 * (4 * wide + 2 * narrow) + 4096 * vocab * 6 + 2 * params)


def test_kv_cache_and_rollout_slots_by_hand():
    """slots x context x layers x kv heads x head dim x 2 (K and V) x 2 bytes, split over the KV heads by tp."""
    per_slot = 32768 * 28 * 2 * 128 * 2 * 2
    assert kv_bytes_per_slot(QWEN_1_5B, 1, 1, 32768) == per_slot
    assert kv_bytes_per_slot(QWEN_1_5B, 4, 1, 32768) == per_slot / 2  # only 2 KV heads to split
    server = rollout_estimate(QWEN_1_5B, 1, 1, 64, 32768)
    assert server.kv_cache == 64 * per_slot and server.params == 2 * QWEN_1_5B.params
    assert server.fits(80 * GB) and not rollout_estimate(QWEN_1_5B, 1, 1, 128, 32768).fits(80 * GB)
    assert usable_bytes(80 * GB) == pytest.approx(72 * GB)


def test_largest_micro_batch_is_the_edge_of_the_fit():
    layout = TrainLayout(ParallelDims(), Precision("float32", "bfloat16", "float32"), 4096, vocab_parallel=False)
    edge = largest_micro_tokens(QWEN_1_5B, layout, 80 * GB)
    assert 0 < edge < 1 << 24
    fits = [
        train_estimate(QWEN_1_5B, TrainLayout(layout.dims, layout.precision, n, vocab_parallel=False)).fits(80 * GB)
        for n in (edge, edge + 1)
    ]
    assert fits == [True, False]


def check_memory_on_l40s(tmp_path, *extra: str):
    """``submit --check-memory L40S`` of the quickstart on a Qwen2.5-1.5B shape (float32 weights,
    bf16 compute), against the dev cluster's real ``sinfo`` (the check follows submit's own, before
    anything is queued)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 1536,
                "num_hidden_layers": 28,
                "num_attention_heads": 12,
                "num_key_value_heads": 2,
                "intermediate_size": 8960,
                "vocab_size": 151936,
                "max_position_embeddings": 4096,
            }
        )
    )
    return run_cli(
        "submit",
        "--check-memory",
        "L40S",
        "--dry-run",
        "--config",
        "configs/quickstart.yaml",
        f"model.path={model}",
        f"cluster.fileroot={tmp_path}",
        *extra,
    )


@pytest.mark.slurm
@pytest.mark.parametrize(
    "extra, message",
    [
        (["actor.max_tokens_per_mb=65536"], "actor.max_tokens_per_mb<="),
        (["actor.max_tokens_per_mb=8192"], "actor.max_tokens_per_mb<="),  # 65 GB without recomputation
        (["actor.max_tokens_per_mb=1024", "rollout.max_running_requests=512"], "rollout.max_running_requests<="),
    ],
)
def test_submit_check_memory_refuses_a_layout_that_cannot_fit(extra, message, tmp_path):
    done = check_memory_on_l40s(tmp_path, *extra)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "L40S" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "quickstart").exists()


@pytest.mark.slurm
def test_submit_check_memory_counts_activation_recomputation(tmp_path):
    """The same 8192-token micro-batches fit with every layer recomputed (34.8 GB of 43.2 usable)."""
    done = check_memory_on_l40s(
        tmp_path, "actor.max_tokens_per_mb=8192", "actor.recompute=full", "rollout.max_running_requests=16"
    )
    assert done.returncode == 0, done.stderr
    assert "memory check on L40S: trainer: 34.77 GB" in done.stderr and "fits in 43.2" in done.stderr
