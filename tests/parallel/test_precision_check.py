"""bfloat16 on a device without bfloat16 arithmetic is one line before anything is built. The CUDA branch
needs a pre-Ampere GPU this machine lacks, so its hardware answer (``torch.cuda.is_bf16_supported``) is
replaced by the one such a GPU gives; CPUs compute bfloat16 through torch and pass."""

from __future__ import annotations

import pytest
import torch

from areal_hpc.errors import UserError
from areal_hpc.parallel.device import check_precision


def test_cpu_takes_bfloat16():
    check_precision(torch.device("cpu"), model_dtype="float32", model_compute_dtype="bfloat16")


def test_a_gpu_without_bfloat16_is_one_line(monkeypatch):
    asked = []
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: asked.append(including_emulation) or False
    )
    check_precision(torch.device("cuda"), model_dtype="float32", model_compute_dtype="float32")
    with pytest.raises(
        UserError,
        match=r"^model\.compute_dtype=bfloat16 but the cuda device here has no bfloat16 "
        r"arithmetic .* set model\.compute_dtype=float32$",
    ):
        check_precision(torch.device("cuda"), model_dtype="float32", model_compute_dtype="bfloat16")
    assert asked == [False]  # emulated bfloat16 (a V100's) does not count
