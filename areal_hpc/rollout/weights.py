"""What keeps a set of tensors from loading into a served model, checked before they touch the live
model (the checkpoint itself is read by ``models.hf.read_checkpoint``)."""

from __future__ import annotations

import difflib

import torch


def weight_mismatches(live: dict[str, torch.Tensor], new: dict[str, torch.Tensor], complete: bool) -> list[str]:
    """What keeps ``new`` from loading into ``live`` (a model's state dict), first offender first:
    unknown names, other shapes, non-floating dtypes, NaN or infinite values (a diverged training step:
    served, it would fail every generation), two values for one tied tensor and, when
    ``complete``, tensors it lacks (a tied tensor may come under any of its names)."""
    problems = []
    for name, tensor in new.items():
        if name not in live:
            nearest = difflib.get_close_matches(name, live, n=1)
            problems.append(
                f"{name} is not a tensor of the served model" + (f" (nearest: {nearest[0]})" if nearest else "")
            )
        elif tensor.shape != live[name].shape:
            problems.append(f"{name} has shape {list(tensor.shape)}; the served model's is {list(live[name].shape)}")
        elif not tensor.dtype.is_floating_point:
            problems.append(
                f"{name} has dtype {tensor.dtype}; weights must be floating point "
                f"(the served model's is {live[name].dtype})"
            )
        elif not (finite := torch.isfinite(tensor)).all():
            problems.append(f"{name} holds {int((~finite).sum())} NaN or infinite values; weights must be finite")
    tied: dict[int, list[str]] = {}  # names of one storage (lm_head.weight and the embedding when tied)
    for name, tensor in live.items():
        tied.setdefault(tensor.data_ptr(), []).append(name)
    missing = [names for names in tied.values() if not any(n in new for n in names)]
    if complete:
        problems += [
            f"{' / '.join(names)} is missing (given {len(tied) - len(missing)} of the served model's "
            f"{len(tied)} tensors)"
            for names in missing
        ]
    for names in tied.values():
        given = [new[n] for n in names if n in new]
        if any(t.shape != given[0].shape or not torch.equal(t.to(given[0].dtype), given[0]) for t in given[1:]):
            problems.append(f"{' and '.join(names)} are one tied tensor in the served model but differ here")
    return problems
