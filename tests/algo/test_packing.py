"""Packing: AReaL's dynamic allocation respects the budget, keeps every sequence once and balances;
the packed forward (per-sequence attention, LM head at targets only, chunked logsumexp) equals Hugging
Face's own forward of each sequence alone with a full log-softmax, values and gradients; context-parallel
shares cover every token once in Megatron's zig-zag chunks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_hpc.algo.packing import dynamic_microbatches, pack, with_filler
from areal_hpc.engines.torch.outputs import packed_policy_outputs, target_logprobs
from areal_hpc.models.hf import load_model
from areal_hpc.models.varlen import PAD_TOLERANCE, length_groups
from areal_hpc.parallel.context import shard


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


def reference_outputs(model, sequences, masks, temperature=1.0):
    """Logprob of each next token and the entropy there, per sequence through the model's own forward (its
    default attention) and a float64 log-softmax over the whole vocabulary, laid out as ``pack`` does."""
    logprobs, entropies = [], []
    for seq, mask in zip(sequences, masks):
        logits = model(input_ids=torch.tensor([seq])).logits[0].double() / temperature
        logp = torch.log_softmax(logits, -1)
        target = torch.tensor(mask[1:] + [0]).bool()
        chosen = logp.gather(-1, torch.tensor(seq[1:] + [0])[:, None])[:, 0]
        logprobs.append(torch.where(target, chosen, 0.0))
        entropies.append(torch.where(target, -(logp.exp() * logp).sum(-1), 0.0))
    return torch.cat(logprobs), torch.cat(entropies)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_forward_equals_each_sequence_alone(tiny_model_dir, temperature):
    model = load_model(tiny_model_dir)
    generator = torch.Generator().manual_seed(0)
    # lengths from 1 to 40: several padded groups, a sequence of one token, prompts of different lengths
    sequences = [torch.randint(3, 600, (n,), generator=generator).tolist() for n in (7, 19, 1, 40, 12, 33, 3)]
    masks = [[0] * min(3, len(s) - 1) + [1] * (len(s) - min(3, len(s) - 1)) for s in sequences]
    assert len(length_groups([len(s) for s in sequences])) > 1

    model.zero_grad()
    packed = packed_policy_outputs(model, pack(sequences, masks), temperature)
    (-packed["logprobs"].sum()).backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref_logprobs, ref_entropy = reference_outputs(model, sequences, masks, temperature)
    (-ref_logprobs.sum()).backward()

    torch.testing.assert_close(packed["logprobs"].double(), ref_logprobs.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed["entropy"].double(), ref_entropy, atol=1e-5, rtol=1e-5)
    assert packed["entropy"][pack(sequences, masks).target_mask].min() > 0
    for a, p in zip(packed_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad.float(), atol=1e-5, rtol=1e-4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=40))
def test_length_groups_cover_every_sequence_within_the_padding_tolerance(lengths):
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert lengths[g[0]] == longest  # the group's block length is its first member's
        assert len(g) == 1 or len(g) * longest**2 <= PAD_TOLERANCE * sum(lengths[i] ** 2 for i in g)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 50), st.integers(2, 300), st.floats(0.3, 2.0), st.integers(1, 64), st.booleans())
def test_chunked_logprobs_equal_full_log_softmax(rows, vocab, temperature, chunk_rows, per_row):
    """At one temperature, or at each row's own (``per_row``: [rows, 1], as a batch of records carries them)."""
    generator = torch.Generator().manual_seed(rows * vocab)
    if per_row:
        temperature = temperature * (0.5 + torch.rand(rows, 1, generator=generator))
    hidden = torch.randn(rows, 16, generator=generator, dtype=torch.float64).float().requires_grad_()
    head = torch.nn.Linear(16, vocab, bias=False)
    tokens = torch.randint(0, vocab, (rows,), generator=generator)
    logprobs, entropy = target_logprobs(hidden, head, tokens, temperature, chunk_bytes=4 * vocab * chunk_rows)
    (logprobs.sum()).backward()
    chunked_grad = hidden.grad.clone()
    hidden.grad = None
    full = torch.log_softmax(head(hidden).double() / temperature, -1)
    full.gather(-1, tokens[:, None]).sum().backward()
    torch.testing.assert_close(logprobs.double(), full.gather(-1, tokens[:, None])[:, 0].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), -(full.exp() * full).sum(-1).detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_grad, hidden.grad, atol=1e-5, rtol=1e-4)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=8),
    st.integers(2, 4),
    st.sampled_from([0, 1, 2]),
    st.integers(0, 2**16),
)
def test_context_shares_cover_each_token_once_in_zigzag_chunks(lengths, cp, pad, seed):
    """Megatron's contract for packed sequences under cp (written from its rotary embedding: each
    rank holds chunks r and 2cp-1-r of 2cp equal chunks of every padded sequence) when padded to a
    multiple of 2cp (x 2: as for sequence parallelism over 2 ranks); every token on exactly one rank,
    and each rank's share of a per-position field, and of the per-position temperatures, is that field's
    values (temperature 1 at padding)."""
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(1, 100, (n,), generator=generator).tolist() for n in lengths]
    temperatures = 0.1 + torch.rand(sum(lengths), generator=generator)
    packed = pack(sequences, [[1] * n for n in lengths], temperatures)
    field = torch.rand(packed.input_ids.shape[1], generator=generator)
    multiple = 2 * cp * pad if pad else 1
    shares = [shard(packed, cp, rank, None, pad_multiple=multiple) for rank in range(cp)]
    padded = [-(-n // multiple) * multiple for n in lengths]
    owner = {}  # (sequence, position) -> rank
    for rank, part in enumerate(shares):
        local = part.split.local_values(field)
        ids = part.input_ids[0]
        for i, (start, stop) in enumerate(part.split.query_ranges):
            positions = part.position_ids[0, start:stop].tolist()
            chunks = torch.arange(padded[i]).tensor_split(2 * cp)
            assert positions == torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]]).tolist()
            for offset, position in enumerate(positions):
                assert (i, position) not in owner
                owner[i, position] = rank
                real = position < lengths[i]
                expected_id = sequences[i][position] if real else 0
                assert ids[start + offset] == expected_id
                original = sum(lengths[:i]) + position
                assert local[start + offset] == (field[original] if real else 0)
                assert part.temperatures[start + offset] == (temperatures[original] if real else 1)
    assert sorted(owner) == [(i, p) for i, n in enumerate(padded) for p in range(n)]


@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), st.integers(1, 8))
def test_a_filler_sequence_keeps_each_positions_temperature(lengths, multiple):
    sequences = [[1] * n for n in lengths]
    temperatures = torch.arange(sum(lengths), dtype=torch.float32) + 0.5
    filled = with_filler(pack(sequences, sequences, temperatures), multiple)
    assert filled.input_ids.shape[1] % multiple == 0
    assert torch.equal(filled.temperatures[: sum(lengths)], temperatures)
    assert bool((filled.temperatures[sum(lengths) :] == 1).all())
    targets = filled.target_mask.nonzero()[:, 0]
    assert torch.equal(filled.target_temperatures(targets, 7.0)[:, 0], temperatures[targets])
    assert bool((pack(sequences, sequences).target_temperatures(targets, 7.0) == 7.0).all())
