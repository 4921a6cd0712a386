"""Shared fixtures: one tiny model built per test session, runners for the real CLI and rollout servers."""

import contextlib
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parent.parent
# Property tests check what holds, not how fast: hypothesis's default 200 ms deadline per example failed a
# countdown reward test at 369 ms on a loaded 2-core machine. Speed targets live in bench/.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")
os.environ["HF_HUB_OFFLINE"] = "1"
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the cores (`make test`): one OpenMP thread per process unless the product sets its
    # own (the launcher does, per role). Two-thread torch ops spin at their barriers whenever the other
    # worker holds a core: an SFT run took 4.6x its time alone so. Set before any test module imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def preset_dir(tmp_path_factory):
    """``preset_dir(name)``: the folder ``areal-hpc init-model --preset name`` writes (seed 0), built once a session."""
    from areal_hpc.data.registry import corpus_for_tokenizer
    from areal_hpc.models.tiny import init_model

    @functools.cache
    def build(preset: str) -> Path:
        return init_model(tmp_path_factory.mktemp(preset) / "model", corpus_for_tokenizer(0), preset=preset, seed=0)

    return build


@pytest.fixture(scope="session")
def tiny_model_dir(preset_dir) -> Path:
    return preset_dir("tiny")


@pytest.fixture(scope="session")
def tiny_moe_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A random Qwen3-MoE model (4 experts, top 2, two layers) with the tiny model's tokenizer; its
    router is initialised at random, so every expert receives tokens."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from areal_hpc.models.hf import load_tokenizer, save_model

    tokenizer = load_tokenizer(tiny_model_dir)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp("moe") / "model"
    save_model(model, tokenizer, folder)
    return folder


def small_llama(vocab_size: int, max_positions: int, original_context: int, tied: bool):
    """A random model of Llama 3's structure at a small size: grouped-query attention, RoPE scaled as
    "llama3" beyond ``original_context`` (Llama 3.1's 8192, or a short one so short sequences cross its
    bands), a head tied to the embedding (1B/3B) or not (8B)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original_context,
    }
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_parameters=rope,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def small_gemma3(vocab_size: int, window: int = 6, softcap: float | None = 1.5, kv_heads: int = 1):
    """A random model of Gemma 3's structure at a small size: two sliding-window layers of ``window`` tokens
    (RoPE base 1e4) then a global one (1e6), ``kv_heads`` key/value heads (gemma-3-1b's one; 4b's ratio of
    two), queries scaled by a query_pre_attn_scalar other than the head dimension, final logits softcapped at
    ``softcap`` (low enough to change them), and (1 + weight) norms drawn away from 1."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=window,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=128,
        final_logit_softcapping=softcap,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """``small_llama`` with Llama 3.1's RoPE constants (a context above the original 8192) and an untied head,
    with the tiny model's tokenizer."""
    from areal_hpc.models.hf import load_tokenizer, save_model

    tokenizer = load_tokenizer(tiny_model_dir)
    folder = tmp_path_factory.mktemp("llama") / "model"
    save_model(small_llama(len(tokenizer), 16384, 8192, tied=False), tokenizer, folder)
    return folder


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """``small_gemma3`` with two key/value heads (tensor parallelism splits them), with the tiny model's tokenizer."""
    from areal_hpc.models.hf import load_tokenizer, save_model

    tokenizer = load_tokenizer(tiny_model_dir)
    folder = tmp_path_factory.mktemp("gemma3") / "model"
    save_model(small_gemma3(len(tokenizer), kv_heads=2), tokenizer, folder)
    return folder


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``areal-hpc`` as a user would: a separate process, its exit code and its output."""
    return subprocess.run(
        [sys.executable, "-m", "areal_hpc", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@contextlib.contextmanager
def embedded_server(model_dir: Path, fileroot: Path, *extra: str):
    """A real ``areal-hpc serve`` process on a free loopback port; yields (process, host:port), then stops it."""
    from areal_hpc.runtime.name_resolve import ROLLOUT_SERVERS, NameResolve

    trial = uuid.uuid4().hex[:8]
    names = NameResolve(fileroot / "quickstart" / trial / "name_resolve")
    names.root.mkdir(parents=True)
    log = open(names.root.parent / "server.log", "w")  # noqa: SIM115 - the server writes it for its lifetime; a file, not a pipe: a full pipe would block the server
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_hpc",
            "serve",
            "backend=embedded",
            f"model.path={model_dir}",
            "port=0",
            f"cluster.fileroot={fileroot}",
            f"experiment.trial={trial}",
            *extra,
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not names.values(ROLLOUT_SERVERS):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not register: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.1)
        yield process, names.values(ROLLOUT_SERVERS)[0]
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)
        log.close()


# Tests marked `slurm` need the dev Slurm cluster (slurm/dev/up.sh), tests marked `mpi` need OpenMPI and
# mpi4py. Where those are missing the tests are skipped, unless AREAL_HPC_REQUIRE_SLURM=1 or
# AREAL_HPC_REQUIRE_MPI=1 (as CI sets them): then they fail with the reason.


@functools.cache
def slurm_missing() -> str | None:
    """Why the dev Slurm cluster cannot run jobs here, or None when both its nodes answer."""
    if shutil.which("sinfo") is None:
        return "sinfo is not installed"
    try:
        done = subprocess.run(["sinfo", "-h", "-N", "-r", "-o", "%N %t"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if done.returncode != 0:
        return f"sinfo failed: {done.stderr.strip()}"
    usable = {
        node
        for node, state in (line.split() for line in done.stdout.splitlines())
        if state in {"idle", "mix", "alloc", "comp"}
    }  # not drained, draining or down
    missing = {"train1", "rollout1"} - usable
    return f"node(s) {', '.join(sorted(missing))} not responding or not usable" if missing else None


@functools.cache
def mpi_missing() -> str | None:
    """Why MPI programs cannot run here (no ``mpirun``, no mpi4py), or None."""
    absent = [
        name
        for name, present in [
            ("mpirun (OpenMPI)", shutil.which("mpirun") is not None),
            ("mpi4py", importlib.util.find_spec("mpi4py") is not None),
        ]
        if not present
    ]
    return f"{' and '.join(absent)} not installed" if absent else None


REQUIREMENTS = {
    "slurm": ("AREAL_HPC_REQUIRE_SLURM", slurm_missing, "dev Slurm cluster is not up: run slurm/dev/up.sh"),
    "mpi": ("AREAL_HPC_REQUIRE_MPI", mpi_missing, "OpenMPI/mpi4py is missing: run slurm/dev/up.sh and install mpi4py"),
}


def pytest_runtest_setup(item):
    for marker, (variable, missing, message) in REQUIREMENTS.items():
        if item.get_closest_marker(marker) is None or (reason := missing()) is None:
            continue
        if os.environ.get(variable) == "1":
            pytest.fail(f"{message} ({reason}; {variable}=1 requires it)", pytrace=False)
        pytest.skip(f"{message} ({reason})")


def pytest_collection_modifyitems(config, items):
    """``make test`` runs two pytest-xdist workers (``--dist loadgroup``): every Slurm test goes to the same
    one, so the dev cluster's two nodes run one test's jobs at a time, as each test expects."""
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.add_marker(pytest.mark.xdist_group("slurm"))
