"""The search agent's reward: exact match and token F1 after SQuAD's answer normalisation (lower case,
no punctuation, no articles a/an/the, single spaces), the answer read from the completion's first
``<answer>...</answer>`` when it has one (else the whole completion).

``reward.fn: areal_hpc.agents.search.reward:exact_match_f1``. ``answer`` may be one text or a list of
acceptable ones (the best of them counts). Only the standard library: reward workers import this alone.
"""

from __future__ import annotations

import re
import string
from collections import Counter

MAX_ANSWER_CHARS = 4096  # what is compared, at most: scoring cost stays bounded whatever the model writes
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def first_tag(text: str, tags: tuple[str, ...]) -> tuple[str, str] | None:
    """(tag, content) of the leftmost complete ``<tag>content</tag>`` in ``text`` among ``tags`` (the
    content ends at the first closing tag after the opening one), or None. Linear in ``text``: what
    ``re.search(r"<(a|b)>(.*?)</\\1>", text, re.S)`` finds, without its quadratic worst case."""
    best = None
    for tag in tags:
        opening, closing = f"<{tag}>", f"</{tag}>"
        start = text.find(opening)
        if start < 0 or (best is not None and start >= best[0]):
            continue
        end = text.find(closing, start + len(opening))
        if end >= 0:  # else no later opening of this tag is closed either
            best = (start, tag, text[start + len(opening) : end])
    return None if best is None else (best[1], best[2])


def extract_answer(completion: str) -> str:
    """The text of the first ``<answer>...</answer>``, else the whole completion."""
    if not isinstance(completion, str):
        return ""
    found = first_tag(completion, ("answer",))
    return found[1] if found is not None else completion


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, punctuation removed, articles removed, whitespace collapsed."""
    text = str(text)[:MAX_ANSWER_CHARS].lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def token_f1(prediction: str, truth: str) -> float:
    """Harmonic mean of token precision and recall after normalisation (1 when both are empty)."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not predicted or not expected:
        return float(predicted == expected)
    same = sum((Counter(predicted) & Counter(expected)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(expected)
    return 2 * precision * recall / (precision + recall)


def _truths(answer) -> list[str]:
    if isinstance(answer, (list, tuple)):
        return [str(a) for a in answer] or [""]
    return ["" if answer is None else str(answer)]


def exact_match_f1(prompt, completion, prompt_ids, completion_ids, answer="", **fields) -> dict:
    """{"reward": exact match (0 or 1), "f1": token F1} of the completion's answer against ``answer``."""
    predicted = extract_answer(completion)
    truths = _truths(answer)
    return {"reward": max(exact_match(predicted, t) for t in truths), "f1": max(token_f1(predicted, t) for t in truths)}
