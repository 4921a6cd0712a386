"""bench/gpu_check.py's dry run: every section of the GPU check runs on the CPU at toy sizes, as CI can,
for every family, and its figures are consistent (the engine decodes exactly the tokens asked for, the
logprobs agree with the float32 reference within the stated tolerance); it writes nothing outside ``--out``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_check import DRY, FAMILY_MODELS, SECTIONS, catalogue_peak_tflops  # noqa: E402


@pytest.mark.slow
def test_dry_run_runs_every_section_for_every_family_and_writes_only_under_out(tmp_path):
    elsewhere, out = tmp_path / "working_directory", tmp_path / "out"
    elsewhere.mkdir()
    done = subprocess.run(
        [sys.executable, ROOT / "bench/gpu_check.py", "--dry-run", "--out", out],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(elsewhere.iterdir()) == []
    assert sorted(path.name for path in out.iterdir()) == ["gpu_check.json", "gpu_check.md"]
    result = json.loads((out / "gpu_check.json").read_text())
    sections = result["sections"]
    assert set(sections) == set(SECTIONS)
    assert not [name for name, section in sections.items() if "error" in section]
    for engine in ("torch_engine", "megatron_engine"):
        assert sections[engine]["tokens"] == DRY.tokens_per_step and sections[engine]["tokens_per_s"] > 0
        assert sections[engine]["microbatches"] >= DRY.tokens_per_step // DRY.tokens_per_mb
    assert sections["logprobs"]["bfloat16"]["within"] and sections["logprobs"]["float32"]["within"]
    assert sections["logprobs"]["float32"]["max_abs"] < 1e-4  # the same device and precision as the reference
    rows = sections["decode"]["rows"]
    assert [row["batch"] for row in rows] == list(DRY.decode_batches)
    assert all(row["tokens"] == row["batch"] * DRY.new_tokens for row in rows)
    attention = sections["attention"]["rows"]
    assert all(row["max_abs_vs_float32"] < 0.05 for row in attention.values())
    assert sections["weight_push"]["bytes"] > 0
    families = sections["families"]["rows"]
    assert set(families) == set(FAMILY_MODELS)
    for row in families.values():
        assert row["torch_engine"]["tokens"] == row["megatron_engine"]["tokens"] == DRY.tokens_per_step, row
        assert row["greedy"]["equal"] == row["greedy"]["sequences"], row
    assert "# GPU check (dry run" in (out / "gpu_check.md").read_text()


def test_device_names_find_their_catalogue_peak():
    assert catalogue_peak_tflops("NVIDIA H200") == 989.0  # not the H20's 148 (a substring of H200)
    assert catalogue_peak_tflops("NVIDIA H20") == 148.0
    assert catalogue_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert catalogue_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert catalogue_peak_tflops("NVIDIA GeForce RTX 4090") is None
