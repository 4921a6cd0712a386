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
