"""One device abstraction for CUDA, Ascend NPU and CPU: components ask it where tensors live.

``resolve_device(kind)`` maps a resolved ``cluster.device`` (cpu, cuda or npu: ``areal_hpc.resolve`` decides
``auto`` from what the node shows) to a torch.device, and says in one line when the node has none of it.
"""

import torch

from areal_hpc.errors import UserError
from areal_hpc.extras import require


def resolve_device(kind: str) -> torch.device:
    """Map a resolved ``cluster.device`` (cpu, cuda, npu) to a torch.device that exists on this machine."""
    if kind == "auto":
        raise ValueError("cluster.device=auto reached the device undecided: resolve(cfg, Host.probe()) decides it")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("cluster.device=cuda but no CUDA device is visible; use cluster.device=cpu or auto")
    if kind == "npu":
        require("torch_npu")
        if not torch.npu.is_available():
            raise UserError("cluster.device=npu but no Ascend NPU is visible; use cluster.device=cpu or auto")
    return torch.device(kind)


def computes_bfloat16(device: torch.device) -> bool:
    """Whether ``device`` has bfloat16 arithmetic of its own (CUDA: compute capability 8.0+, not the slow
    emulation older GPUs offer; Ascend: what torch-npu reports; CPUs: always, through torch)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "npu":
        return torch.npu.is_bf16_supported()
    return True


def check_precision(device: torch.device, **dtypes: str) -> None:
    """``UserError`` (one line) when a dtype setting, given as ``key=value`` (e.g. ``model_compute_dtype=
    "bfloat16"``), asks ``device`` for bfloat16 it cannot compute in."""
    for key, dtype in dtypes.items():
        if dtype == "bfloat16" and not computes_bfloat16(device):
            name = key.replace("_", ".", 1)
            raise UserError(
                f"{name}=bfloat16 but the {device.type} device here has no bfloat16 arithmetic "
                f"(NVIDIA GPUs need compute capability 8.0 or later, e.g. A100, H100); set {name}=float32"
            )
