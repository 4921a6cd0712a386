"""GSM8K-format word problems from local data ({"question": ..., "answer": "... #### N"} rows, in any
form ``dataset.path`` takes: JSONL, Parquet, Arrow, a folder).

Reward 1.0 when the completion's final answer (after the last '####', else its last number) equals N.
Nothing is downloaded: point ``dataset.path`` at a local copy; the shipped sample serves tests.
"""

from __future__ import annotations

from dataclasses import replace
from importlib import resources
from pathlib import Path

from areal_hpc.config import DatasetConfig
from areal_hpc.data.rewards import RewardFunction, last_number, parse_number, tail
from areal_hpc.data.tasks import Task
from areal_hpc.data.user_data import read_rows, split_examples
from areal_hpc.errors import UserError

SAMPLE = "gsm8k_sample.jsonl"


def sample_path() -> Path:
    return Path(str(resources.files("areal_hpc.data") / "samples" / SAMPLE))


def final_answer(text: str):
    """The number after the last '####' marker, or the last number in the text."""
    text = tail(text)
    marker = text.rfind("####")
    return last_number(text[marker + 4 :] if marker >= 0 else text)


def gsm8k_rows(path: str, key: str, split: str) -> list[dict]:
    """GSM8K rows as the generic mapping reads them: prompt (the question), target (the worked answer) and
    answer (its number after '####')."""
    rows = []
    for i, row in enumerate(read_rows(path, key, split)):
        question, answer = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str):
            raise UserError(
                f"{path} row {i}: not a GSM8K row with text 'question' and 'answer' (its columns: {', '.join(row)})"
            )
        if "####" not in answer or final_answer(answer) is None:
            raise UserError(f"{path} row {i}: answer must end with '#### <number>', got {answer[-40:]!r}")
        rows.append({"prompt": question, "target": answer.strip(), "answer": answer.rsplit("####", 1)[1].strip()})
    return rows


def reward(prompt: str, completion: str, prompt_ids, completion_ids, answer: str, **fields) -> float:
    got = final_answer(completion)
    return 1.0 if got is not None and got == parse_number(answer) else 0.0


def make_task(cfg: DatasetConfig) -> Task:
    mapping = replace(
        cfg, path=cfg.path or str(sample_path()), prompt_field="prompt", answer_field="answer", target_field="target"
    )
    train, held_out = split_examples(mapping, "gsm8k", gsm8k_rows)
    return Task("gsm8k", train, held_out, RewardFunction(reward))
