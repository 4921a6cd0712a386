"""One device abstraction for CUDA, Ascend NPU and CPU: components ask it where tensors live.

``resolve_device("auto")`` picks cuda, then npu (when torch-npu is installed), then cpu.
"""

import importlib.util

import torch

from areal_hpc.errors import UserError
from areal_hpc.extras import require


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    require("torch_npu")  # registers the "npu" device with torch
    return torch.npu.is_available()


def resolve_device(kind: str = "auto") -> torch.device:
    """Map ``cluster.device`` (auto, cpu, cuda, npu) to a torch.device that exists on this machine."""
    if kind == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("npu" if _npu_available() else "cpu")
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
