"""Virtual pipeline stages on the Megatron engine (``actor.parallel.vpp``, Megatron's interleaved 1F1B):
pp2 x vpp2 on the 4-layer tiny model (each rank holds two one-layer chunks: virtual stages r and r + 2)
takes the torch engine's step in one process -- outputs, loss, gradient norm, weights -- and its
checkpoint restores the next step; layouts that cannot interleave are one ``UserError``. The ranks are
``tests.megatron_ranks`` with the virtual pipeline size added, this module as their script:

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p OMP_NUM_THREADS=1 \\
        python -m tests.engines.test_megatron_vpp MODEL OUT pp=2 vpp=2 [save=DIR]
"""

from __future__ import annotations

import functools
import sys

import pytest
from transformers import AutoConfig

from areal_hpc.engines.megatron.convert import ModelShape
from areal_hpc.engines.megatron.model import check_layout
from areal_hpc.errors import UserError
from areal_hpc.layout import ParallelDims
from tests import megatron_ranks, native_ranks
from tests.engines.test_megatron import in_reference_order
from tests.engines.test_torch_parallel import assert_same_step
from tests.native_ranks import reference_run
from tests.trainer_processes import end_rank, run_ranks

MAX_TOKENS_PER_MB = 32  # 5 micro-batches in the step, 6 in the next: odd counts, beyond one group of pp


def main(model_dir: str, out: str, args: list[str]) -> None:
    vpp = int(dict(a.split("=", 1) for a in args)["vpp"])
    native_ranks.ParallelDims = functools.partial(ParallelDims, vpp=vpp)  # the mesh the ranks build
    native_ranks.MAX_TOKENS_PER_MB = MAX_TOKENS_PER_MB
    megatron_ranks.main(model_dir, out, args)


@pytest.mark.distributed
def test_pp2_vpp2_step_equals_the_torch_engine_in_one_process(tiny_model_dir, tmp_path):
    """The interleaved schedule over 5 micro-batches (an idle pass completes the last group of pp), the
    tied embedding's two copies on the first and last chunks, the weights of both chunks in the pushed
    and saved folder, and the checkpoint's next step (6 micro-batches). Measured: logprobs within 4.8e-7,
    loss and gradient norm within 5e-7 relative, weights within 6e-8 of the torch engine's."""
    folder = tmp_path / "checkpoint"
    got = run_ranks(
        2,
        tiny_model_dir,
        tmp_path / "out.pt",
        "pp=2",
        "vpp=2",
        f"save={folder}",
        timeout=120,
        module="tests.engines.test_megatron_vpp",
    )
    reference = reference_run(tiny_model_dir)
    assert_same_step(in_reference_order(got, reference), reference)
    assert got["ranks"][0]["restored_step_diff"] == 0.0


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(pp=2, vpp=3), "pp=2 x vpp=3 = 6 virtual stages must divide the model's num_hidden_layers=4"),
        (dict(pp=4, vpp=2), "pp=4 x vpp=2 = 8 virtual stages must divide the model's num_hidden_layers=4"),
    ],
)
def test_virtual_stages_not_dividing_the_layers_are_one_user_error(sizes, message, tiny_model_dir):
    shape = ModelShape.from_hf(AutoConfig.from_pretrained(tiny_model_dir))
    with pytest.raises(UserError, match=message) as error:
        check_layout(ParallelDims(**sizes), shape)
    assert "\n" not in str(error.value)


def test_vpp_without_pipeline_is_one_user_error():
    with pytest.raises(UserError, match="actor.parallel.vpp=2 needs pp > 1") as error:
        ParallelDims(dp=2, vpp=2).check(2)
    assert "\n" not in str(error.value)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    end_rank()
