"""The ``TrainEngine`` surface on the torch engine: SFT as a loss function equals the batch's mean
token NLL (float64 reference, loss and gradients), rollout weights come in bounded buckets under
Hugging Face names, save/load restores model and optimizer, and the in-process evaluation (the
embedded engine on the model) decodes what transformers' greedy ``generate`` does."""

from __future__ import annotations

import itertools

import pytest
import torch

from areal_hpc.agents.engine import Sampling
from areal_hpc.config import OptimizerConfig
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.tasks import Example
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import packed_policy_outputs
from areal_hpc.models.chat import prompt_ids
from areal_hpc.models.hf import load_model, load_tokenizer
from areal_hpc.train.evaluate import evaluate_model
from areal_hpc.train.sft import sft_batch, sft_step
from tests.conftest import small_gemma3


def is_target(prompt, completion: str, prompt_ids, completion_ids, answer: str, **fields) -> float:
    """A reward (module level, so reward workers import it): the completion is exactly the answer."""
    return float(completion == answer)


def engine_on(model_dir, clip: float = 0.0, max_tokens_per_mb: int = 4096) -> TorchTrainEngine:
    return engine_of(load_model(model_dir), clip, max_tokens_per_mb, load_tokenizer(model_dir))


def engine_of(model, clip: float = 0.0, max_tokens_per_mb: int = 4096, tokenizer=None) -> TorchTrainEngine:
    return TorchTrainEngine(
        model,
        packed_policy_outputs,
        lr=1e-3,
        total_steps=10,
        optimizer=OptimizerConfig(gradient_clipping=clip),
        max_tokens_per_mb=max_tokens_per_mb,
        tokenizer=tokenizer,
    )


def sft_pairs(n: int = 6, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        prompt, completion = (
            torch.randint(3, 600, (int(k),), generator=generator).tolist()
            for k in torch.randint(2, 12, (2,), generator=generator)
        )
        pairs.append((prompt + completion, [0] * len(prompt) + [1] * len(completion)))
    return pairs


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_sft_step_is_the_mean_completion_token_nll_of_the_whole_batch(family, tiny_model_dir):
    """Packed micro-batches of several sequences against a float64 forward of each sequence alone: the
    logprobs, the loss and the gradients. Gemma 3 (``small_gemma3``): sliding-window layers of 4 tokens in
    sequences of up to 22, each kind with its RoPE base, and softcapped logits."""
    build = (lambda: load_model(tiny_model_dir)) if family == "qwen2" else (lambda: small_gemma3(640, window=4))
    pairs = sft_pairs()
    engine = engine_of(build(), max_tokens_per_mb=24)  # several micro-batches
    logprobs_of = engine.forward(sft_batch(pairs))["logprobs"]
    stats = sft_step(engine, pairs)

    reference = build().double()  # one sequence at a time
    nll, count = torch.zeros((), dtype=torch.float64), 0
    for (tokens, mask), got in zip(pairs, logprobs_of):
        logprobs = torch.log_softmax(reference(input_ids=torch.tensor([tokens])).logits[0], dim=-1)
        for t in range(1, len(tokens)):
            if mask[t]:
                assert got[t - 1].item() == pytest.approx(logprobs[t - 1, tokens[t]].item(), abs=1e-5)
                nll, count = nll - logprobs[t - 1, tokens[t]], count + 1
    (nll / count).backward()

    assert stats["train/microbatches"] > 1
    assert stats["train/tokens"] == sum(len(s) for s, _ in pairs)
    assert stats["train/loss"] == pytest.approx((nll / count).item(), rel=1e-5)
    got = dict(engine.model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name].grad.double(), p.grad, rtol=1e-3, atol=1e-6, msg=name)


def test_rollout_weights_are_every_tensor_once_in_bounded_buckets(tiny_model_dir):
    engine = engine_on(tiny_model_dir)
    state = engine.model.state_dict()
    limit = 200_000
    buckets = list(engine.rollout_weights(limit))
    names = [name for bucket in buckets for name, _ in bucket]
    assert names == list(state)  # Hugging Face names, each once, in state-dict order
    for bucket in buckets:
        for name, tensor in bucket:
            assert torch.equal(tensor, state[name])
    sizes = [[t.numel() * t.element_size() for _, t in bucket] for bucket in buckets]
    assert all(sum(s) <= limit or len(s) == 1 for s in sizes)  # within the limit, or one tensor too big for it
    assert all(sum(a) + b[0] > limit for a, b in itertools.pairwise(sizes))  # each bucket as full as it could be


def test_save_and_load_restore_weights_and_optimizer(tiny_model_dir, tmp_path):
    trained, restored = engine_on(tiny_model_dir), engine_on(tiny_model_dir)
    sft_step(trained, sft_pairs(seed=1))
    trained.save(tmp_path / "full")
    trained.save(tmp_path / "weights_only", optimizer=False)
    assert {p.name for p in (tmp_path / "full").iterdir()} - {
        p.name for p in (tmp_path / "weights_only").iterdir()
    } == {"training_state.pt"}
    restored.load(tmp_path / "full")
    # the next step from the restored engine (Adam moments, schedule position) is the trained one's
    sft_step(trained, sft_pairs(seed=2))
    sft_step(restored, sft_pairs(seed=2))
    for (name, a), b in zip(trained.model.state_dict().items(), restored.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_in_process_evaluation_decodes_like_transformers_greedy_generate(tiny_model_dir):
    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the fresh model repeats one token whatever the prompt; this one does not
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    prompts = ["What is 3 + 4?", "What is 12 + 30?", "Compute 99 + 1, then say it twice."]
    expected, distinct_tokens = [], []
    for prompt in prompts:  # transformers' own decoder, one prompt at a time, no padding
        ids = torch.tensor([prompt_ids(tokenizer, prompt)])
        out = model.generate(
            input_ids=ids,
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        expected.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
        distinct_tokens.append(len(set(out[0, ids.shape[1] :].tolist())))
    # the reward says whether the completion is the one transformers decoded
    examples = [
        Example(str(i), prompt, answer=target)
        for i, (prompt, target) in enumerate(zip(prompts, expected[:2] + ["not that"]))
    ]
    with RewardPool(is_target) as rewards:
        result = evaluate_model(model, tokenizer, examples, rewards, Sampling(max_new_tokens=8))
    assert len(set(expected)) == 3 and min(distinct_tokens) > 2
    assert [completion for _, completion, _ in result.samples] == expected
    assert (result.correct, result.n) == (2, 3)
