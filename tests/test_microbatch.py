"""Packing: FFD respects the budget and keeps every sequence once; packed == per-sequence forward."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.microbatch import allocate_microbatches, pack
from areal_hpc.models.hf import load_model
from areal_hpc.train.logprobs import packed_token_logprobs


@settings(max_examples=300)
@given(st.lists(st.integers(1, 300), max_size=60), st.integers(16, 512))
def test_ffd_assigns_every_sequence_once_within_budget(lengths, budget):
    groups = allocate_microbatches(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or sum(lengths[i] for i in g) <= budget
    loads = [sum(lengths[i] for i in g) for g in groups]
    for j, group in enumerate(groups):
        assert [lengths[i] for i in group] == sorted((lengths[i] for i in group), reverse=True)  # decreasing
        # first fit: every sequence of a later group did not fit into any earlier one
        assert all(loads[i] + min(lengths[k] for k in group) > budget for i in range(j))


def test_target_mask_never_crosses_sequences():
    batch = pack([[1, 2, 3], [4, 5]], [[0, 1, 1], [1, 1]])
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5]
    # position 0 predicts 2 (target), 1 predicts 3 (target), 2 would predict 4 across the boundary
    assert batch.target_mask.tolist() == [True, True, False, True, False]


def test_packed_logprobs_and_gradients_equal_unpacked(tiny_model_dir):
    model = load_model(tiny_model_dir)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 600, (n,), generator=generator).tolist() for n in (7, 19, 4, 12)]
    masks = [[0] * 3 + [1] * (len(s) - 3) for s in sequences]

    def loss_and_grads(batches):
        model.zero_grad()
        logprobs = torch.cat([packed_token_logprobs(model, b) for b in batches])
        (-logprobs.sum()).backward()
        return logprobs.detach(), [p.grad.clone() for p in model.parameters()]

    packed_lp, packed_grads = loss_and_grads([pack(sequences, masks)])
    single_lp, single_grads = loss_and_grads([pack([s], [m]) for s, m in zip(sequences, masks)])
    torch.testing.assert_close(packed_lp, single_lp, atol=1e-5, rtol=1e-5)
    for a, b in zip(packed_grads, single_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
