"""Megatron-core 0.16 on CPU (gloo): the few places where it calls CUDA unconditionally, redirected to
the CPU in one place. ``apply()`` is idempotent and is called only when the trainer's device is CPU;
on CUDA Megatron runs untouched (but for ``without_transformer_engine``, where that is absent, and
``interleaving_shapes_by_direction`` under virtual pipeline stages).

Each patched module sees ``torch`` through ``_CpuTorch``: ``torch.cuda.current_device()`` is the CPU,
tensor factories asked for ``device="cuda"`` make CPU tensors, streams and synchronisation are no-ops,
and the CUDA RNG calls use the CPU generator. Nothing global in torch changes (aliasing
``torch.cuda.manual_seed`` to ``torch.manual_seed`` globally recurses: the latter calls the former).
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch

_applied = False


def _cpu(device):
    return "cpu" if device is not None and str(device).startswith("cuda") else device


def _on_cpu(factory):
    def make(*args, device=None, pin_memory=False, **kwargs):
        return factory(*args, device=_cpu(device), **kwargs)

    return make


class _NoStream:
    """A CUDA stream on the CPU: everything is already in order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args, **kwargs) -> _NoStream:
        """An event that has already happened (it only needs ``synchronize``)."""
        return self


class _CpuCuda:
    """``torch.cuda`` as the patched modules see it; anything not listed is the real one."""

    Stream = _NoStream  # DDP's communication stream, param/grad buffer streams
    current_device = staticmethod(lambda: torch.device("cpu"))  # p2p shapes, GlobalMemoryBuffer, buffers
    synchronize = staticmethod(lambda *args, **kwargs: None)  # p2p after batched isend/irecv
    stream = staticmethod(lambda *args, **kwargs: contextlib.nullcontext())
    default_stream = current_stream = staticmethod(lambda *args, **kwargs: _NoStream())
    get_rng_state = staticmethod(lambda *args, **kwargs: torch.get_rng_state())  # the RNG tracker's states
    set_rng_state = staticmethod(lambda state, *args, **kwargs: torch.set_rng_state(state))
    manual_seed = staticmethod(lambda seed: torch.manual_seed(seed))  # model_parallel_cuda_manual_seed

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch:
    """``torch`` for the patched modules: ``cuda`` is ``_CpuCuda`` and factories map cuda to cpu
    (the schedules' token counter is made with ``device="cuda"``)."""

    cuda = _CpuCuda()
    zeros, ones, empty, tensor, arange = (
        staticmethod(_on_cpu(f)) for f in (torch.zeros, torch.ones, torch.empty, torch.tensor, torch.arange)
    )

    def __getattr__(self, name):
        return getattr(torch, name)


# The modules that call CUDA on the training path, and why.
MODULES = (
    "megatron.core.tensor_parallel.random",  # CUDA RNG tracker, model_parallel_cuda_manual_seed
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor(device=torch.cuda.current_device())
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens on "cuda"
    "megatron.core.pipeline_parallel.p2p_communication",  # shape tensors on current_device(), synchronize()
    "megatron.core.distributed.distributed_data_parallel",  # torch.cuda.Stream, synchronize
    "megatron.core.distributed.param_and_grad_buffer",  # grad buffers on current_device(), streams
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # moves inv_freq to current_device()
    "megatron.core.tensor_parallel.mappings",  # the experts' uneven all-to-all output on current_device()
    "megatron.core.tensor_parallel.layers",  # sequence parallelism: the gathered input's buffer on current_device()
    "megatron.core.transformer.moe.router",  # moves a CPU router weight to current_device()
    "megatron.core.transformer.moe.token_dispatcher",  # a device-to-host copy stream and its event
    "megatron.core.optimizer.optimizer",  # the bf16 optimizer's unit loss scale on "cuda"
    "megatron.core.optimizer.clip_grads",  # the distributed optimizer's gradient norm on "cuda"
)


class _CpuDeviceMesh:
    """``DeviceMesh`` for Megatron's FSDP2 wrapper, which builds its mesh from a group for "cuda"."""

    @staticmethod
    def from_group(group, device_type: str, *args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(state)


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the CPU: the token dispatcher's
    all-to-all split sizes must still become numpy arrays (``all_to_all_single`` takes no tensors)."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _with_tensor_method(method, name: str, replacement):
    """``method`` with ``torch.Tensor.<name>`` replaced by ``replacement(original)`` while it runs."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        original = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, replacement(original))
        try:
            return method(*args, **kwargs)
        finally:
            setattr(torch.Tensor, name, original)

    return run


def _stays_on_cpu(cuda):
    """``Tensor.cuda()`` returning the tensor itself."""
    return lambda tensor, *args, **kwargs: tensor


def _typed_as_cuda(type_of):
    """``Tensor.type()`` naming a CPU tensor's type as its CUDA twin's ("torch.cuda.BFloat16Tensor")."""

    def named(tensor, *args, **kwargs):
        if args or kwargs or tensor.is_cuda:
            return type_of(tensor, *args, **kwargs)
        return type_of(tensor).replace("torch.", "torch.cuda.", 1)

    return named


def apply() -> None:
    """Patch the modules in ``MODULES`` (once; later calls do nothing)."""
    global _applied
    if _applied:
        return
    cpu_torch = _CpuTorch()
    for name in MODULES:
        importlib.import_module(name).torch = cpu_torch
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _get_rng_state  # the tracker's fork() saves and restores through these
    random._set_cuda_rng_state = _set_rng_state
    importlib.import_module("megatron.core.transformer.moe.token_dispatcher").maybe_move_tensor_to_cpu = _host_copy
    importlib.import_module("megatron.core.distributed.torch_fully_sharded_data_parallel").DeviceMesh = _CpuDeviceMesh
    language = importlib.import_module("megatron.core.models.common.language_module.language_module").LanguageModule
    # With pp > 1 and tied embeddings the last stage's copy is synchronised after weight.data.cuda().
    language.setup_embeddings_and_output_layer = _with_tensor_method(
        language.setup_embeddings_and_output_layer, "cuda", _stays_on_cpu
    )
    # The bf16 and distributed optimizers take a parameter (for fp32 master weights, or a shard of it) only
    # if its type() is a CUDA one.
    for optimizer in (
        importlib.import_module("megatron.core.optimizer.optimizer").Float16OptimizerWithFloat16Params,
        importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer,
    ):
        optimizer.__init__ = _with_tensor_method(optimizer.__init__, "type", _typed_as_cuda)
    # Its clipping asserts that the shards' gradients are "torch.cuda.FloatTensor".
    optimizer_module = importlib.import_module("megatron.core.optimizer.optimizer")
    optimizer_module.clip_grad_by_total_norm_fp32 = _with_tensor_method(
        optimizer_module.clip_grad_by_total_norm_fp32, "type", _typed_as_cuda
    )
    _applied = True


def _shapes_by_direction(self, tensor_send_next, tensor_send_prev, recv_prev: bool, recv_next: bool):
    """``P2PCommunicator._communicate_shapes`` through ``_p2p_ops``, as the tensors go without batching.
    With pp = 2 a stage's previous and next stage are one peer, and interleaved 1F1B sends both ways at
    once: the batched exchange then hands a shape sent backward to the receive of one sent forward (a
    micro-batch's length for another's). ``_p2p_ops`` keeps the two directions on two process groups."""
    p2p = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication")
    device = p2p.torch.cuda.current_device()

    def shape_of(tensor):
        return None if tensor is None else torch.tensor(tensor.size(), dtype=torch.int64, device=device)

    def buffer(wanted: bool):
        return torch.empty(3, dtype=torch.int64, device=device) if wanted else None

    received = {"prev": buffer(recv_prev), "next": buffer(recv_next)}
    requests = p2p._p2p_ops(
        tensor_send_prev=shape_of(tensor_send_prev),
        tensor_recv_prev=received["prev"],
        tensor_send_next=shape_of(tensor_send_next),
        tensor_recv_next=received["next"],
        group=self.pp_group,
        prev_pipeline_rank=self.prev_rank,
        next_pipeline_rank=self.next_rank,
    )
    for request in requests.values():
        request.wait()
    return tuple([0, 0, 0] if shape is None else shape.tolist() for shape in received.values())


def interleaving_shapes_by_direction() -> None:
    """Megatron's interleaved schedule with micro-batches of varied lengths (any device): their shapes
    exchanged direction by direction (``_shapes_by_direction``); the engine also sends the tensors
    unbatched (``batch_p2p_comm=False``), which does the same for them."""
    p2p = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication")
    p2p.P2PCommunicator._communicate_shapes = _shapes_by_direction


def without_transformer_engine() -> None:
    """Megatron without Transformer Engine (any device): the MoE router's linear layer tests
    ``te_general_gemm is not None``, a name bound only when Transformer Engine imports; without it the
    plain matmul is meant."""
    importlib.import_module("megatron.core.transformer.moe.moe_utils").__dict__.setdefault("te_general_gemm", None)
