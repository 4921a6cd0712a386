"""Packing: AReaL's dynamic allocation respects the budget, keeps every sequence once and balances;
packed == per-sequence forward."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.packing import dynamic_microbatches, pack
from areal_hpc.models.hf import load_model
from areal_hpc.train.logprobs import packed_token_logprobs


@settings(max_examples=300)
@given(st.lists(st.integers(1, 300), max_size=60), st.integers(16, 512), st.integers(1, 8))
def test_dynamic_allocation_assigns_every_sequence_once_within_budget(lengths, budget, min_groups):
    groups = dynamic_microbatches(lengths, budget, min_groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or sum(lengths[i] for i in g) <= budget
    assert len(groups) >= min(min_groups, len(lengths))


def test_dynamic_allocation_balances_where_first_fit_would_fill():
    # 4 and 3 open the two required groups; 2 ties and joins the first; each 1 joins the group with fewer sequences
    # (first fit would put all five into one group)
    assert dynamic_microbatches([4, 3, 2, 1, 1], 11, min_groups=2) == [[0, 2, 4], [1, 3]]
    # the fewest-sequences rule only picks among groups with room: 5 opens a third group, 3 can only join it
    assert dynamic_microbatches([9, 8, 5, 3, 2, 1], 10, min_groups=2) == [[0, 5], [1, 4], [2, 3]]


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
