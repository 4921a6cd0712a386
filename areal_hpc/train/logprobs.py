"""Per-token log-probabilities of a packed batch: the one forward every trainer shares."""

import torch

from areal_hpc.algo.microbatch import PackedBatch


def packed_token_logprobs(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """[T] log p(token t+1 | tokens <= t) within each sequence (0 where nothing is predicted)."""
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[0]
    next_tokens = torch.roll(batch.input_ids[0], shifts=-1)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, next_tokens[:, None])[:, 0]
    return torch.where(batch.target_mask, logprobs, torch.zeros_like(logprobs))
