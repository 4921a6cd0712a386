"""The per-position forwards of a packed batch that every trainer shares: the policy's logprob of
the next token, and a critic's value estimate."""

import torch

from areal_hpc.algo.packing import PackedBatch


def packed_token_logprobs(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """[T] log p(token t+1 | tokens <= t) within each sequence (0 where nothing is predicted)."""
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0]
    next_tokens = torch.roll(batch.input_ids[0], shifts=-1)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, next_tokens[:, None])[:, 0]
    return torch.where(batch.target_mask, logprobs, torch.zeros_like(logprobs))


def packed_values(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """[T] the critic's value of the state after token t (the state in which token t+1 is chosen)."""
    return model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0, :, 0].float()
