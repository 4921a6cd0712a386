"""GSM8K-format word problems from a local JSONL file: {"question": ..., "answer": "... #### N"}.

Reward 1.0 when the completion's final answer (after the last '####', else its last number) equals N.
Nothing is downloaded: point ``dataset.path`` at a local copy; the shipped sample serves tests.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

from areal_hpc.config import DatasetConfig
from areal_hpc.data.rewards import last_number, parse_number, tail
from areal_hpc.data.tasks import Example, Task
from areal_hpc.errors import UserError

SAMPLE = "gsm8k_sample.jsonl"


def sample_path() -> Path:
    return Path(str(resources.files("areal_hpc.data") / "samples" / SAMPLE))


def final_answer(text: str):
    """The number after the last '####' marker, or the last number in the text."""
    text = tail(text)
    marker = text.rfind("####")
    return last_number(text[marker + 4:] if marker >= 0 else text)


def load_jsonl(path: str | Path) -> list[Example]:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"GSM8K file not found: {path} (dataset.path must be a local JSONL file)")
    examples = []
    for lineno, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question, answer = row["question"], row["answer"]
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            raise UserError(f"{path}:{lineno}: not a GSM8K row with 'question' and 'answer' ({exc})") from None
        number = final_answer(answer) if "####" in answer else None
        if number is None:
            raise UserError(f"{path}:{lineno}: answer must end with '#### <number>', got {answer[-40:]!r}")
        examples.append(Example(uid=f"{file.stem}/{lineno}", prompt=question, target=answer.strip(),
                                answer=answer.rsplit("####", 1)[1].strip()))
    if not examples:
        raise UserError(f"GSM8K file {path} holds no rows")
    return examples


def reward(completion: str, example: Example) -> float:
    got = final_answer(completion)
    return 1.0 if got is not None and got == parse_number(example.answer) else 0.0


def make_task(cfg: DatasetConfig) -> Task:
    rows = load_jsonl(cfg.path or sample_path())
    if cfg.eval_path:
        train, held_out = rows, load_jsonl(cfg.eval_path)
    else:  # hold out a seeded part of the one file, at most half of it
        rows = random.Random(f"gsm8k-{cfg.seed}").sample(rows, len(rows))
        n_eval = min(cfg.eval_size, len(rows) // 2)
        train, held_out = rows[n_eval:], rows[:n_eval]
    return Task("gsm8k", train[: cfg.train_size], held_out[: cfg.eval_size], reward)
