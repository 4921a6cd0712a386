"""Your data: JSONL, Parquet or Arrow files (one, a glob, or a folder of them) and folders written by
``datasets``' ``save_to_disk``, read offline with the ``datasets`` library, and turned into examples by
a field mapping (``dataset.prompt_field``, ``answer_field``, ``target_field``); every other column
travels with the example to the reward and the workflow.

A prompt is text (rendered as one user turn) or OpenAI chat messages (``[{"role", "content"}, ...]``; an
assistant's may hold ``tool_calls``, ``reasoning_content`` and an SFT ``weight``), rendered by the model's chat
template. A ``tools`` column holds the OpenAI function tools offered with the prompt (a list, or that list as
JSON text). Parquet and Arrow give a row's objects the keys of every row's, as nulls: null values are dropped
(JSON text is read as written). Held-out data comes from ``eval_path``, else the ``eval_split`` of a saved
``DatasetDict``, else ``eval_size`` rows held out of ``path`` by ``seed``.
"""

from __future__ import annotations

import glob
import json
import os
import random
from pathlib import Path

from areal_hpc.data.tasks import Example
from areal_hpc.errors import UserError

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
FORMS = "a JSONL, Parquet or Arrow file, a glob or a folder of them, or a datasets.save_to_disk folder"
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "weight")
MESSAGES = "a list of {'role', 'content'} messages"
TOOL_CALLS = "[{'type': 'function', 'function': {'name': ..., 'arguments': JSON text}}, ...]"
TOOLS = (
    "a list of OpenAI function tools [{'type': 'function', 'function': {'name': ..., 'description': ..., "
    "'parameters': {...}}}, ...], or that list as JSON text"
)


def _datasets():
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never ask a hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    return datasets


def read_rows(path: str, key: str, split: str = "train") -> list[dict]:
    """The rows at ``path`` (``key``: its config key, for errors); a saved DatasetDict gives ``split``."""
    datasets = _datasets()
    folder = Path(path)
    if folder.is_dir() and (folder / "dataset_dict.json").is_file():
        saved = datasets.load_from_disk(str(folder))
        if split not in saved:
            raise UserError(f"config key '{key}': {path} has splits {', '.join(saved)}, not {split!r}")
        return saved[split].to_list()
    if folder.is_dir() and (folder / "state.json").is_file():
        return datasets.load_from_disk(str(folder)).to_list()
    files = data_files(path, key)
    builder = FORMATS[Path(files[0]).suffix]
    try:
        table = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as exc:  # noqa: BLE001 - pyarrow/datasets raise many kinds on a malformed file
        raise UserError(f"config key '{key}': cannot read {path}: {type(exc).__name__}: {str(exc)[:300]}") from None
    return table.to_list()


def data_files(path: str, key: str) -> list[str]:
    """The files ``path`` names, all of one format."""
    if any(ch in path for ch in "*?["):
        files = sorted(glob.glob(path, recursive=True))
    elif Path(path).is_dir():
        files = sorted(str(p) for p in Path(path).rglob("*") if p.suffix in FORMATS)
    elif Path(path).is_file():
        files = [path]
    else:
        raise UserError(f"config key '{key}': {path!r} does not exist (give {FORMS})")
    if not files:
        raise UserError(f"config key '{key}': {path!r} holds no data files ({', '.join(FORMATS)})")
    unknown = [f for f in files if Path(f).suffix not in FORMATS]
    kinds = {FORMATS.get(Path(f).suffix) for f in files}
    if unknown or len(kinds) > 1:
        raise UserError(
            f"config key '{key}': {(unknown or files)[0]!r}: give files of one format, one of {', '.join(FORMATS)}"
        )
    return files


def examples_from_rows(rows: list[dict], cfg, source: str) -> list[Example]:
    """Examples by the mapping of ``cfg`` (a ``DatasetConfig``); ``source`` names the data in errors."""
    if not rows:
        raise UserError(f"{source} holds no rows")
    columns = list(rows[0])
    prompt_key = cfg.prompt_field or next((c for c in ("prompt", "messages") if c in columns), None)
    target_key = cfg.target_field or ("target" if "target" in columns else "")
    for what, column in (
        ("dataset.prompt_field", prompt_key),
        ("dataset.answer_field", cfg.answer_field),
        ("dataset.target_field", target_key),
    ):
        if column is None or (column and column not in columns):
            shown = column or "prompt or messages"
            raise UserError(
                f"config key '{what}': {source} has no column {shown!r}; its columns are {', '.join(columns)}"
            )
    mapped = {prompt_key, cfg.answer_field, target_key, "tools"}
    return [
        _example(row, f"{source}/{i}", prompt_key, cfg.answer_field, target_key, mapped) for i, row in enumerate(rows)
    ]


def _example(row: dict, uid: str, prompt_key: str, answer_key: str, target_key: str, mapped: set) -> Example:
    prompt = row[prompt_key]
    if isinstance(prompt, list):
        text, messages = "", chat_messages(prompt, f"{uid}: column {prompt_key!r}")
    elif isinstance(prompt, str):
        text, messages = prompt, ()
    else:
        raise UserError(
            f"{uid}: column {prompt_key!r} is {type(prompt).__name__} {str(prompt)[:80]!r}; a prompt is "
            f"text or {MESSAGES}"
        )
    fields = {k: v for k, v in row.items() if k not in mapped}
    answer = row[answer_key] if answer_key else ""
    target = row[target_key] if target_key else ""
    return Example(
        uid=uid,
        prompt=text,
        target="" if target is None else str(target),
        answer="" if answer is None else answer,
        fields=fields,
        messages=messages,
        tools=tool_list(row.get("tools"), uid),
    )


def without_nulls(value):
    """``value`` with the null values of its objects dropped, at every depth."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def chat_messages(value: list, where: str) -> tuple[dict, ...]:
    """OpenAI chat messages, their keys among ``MESSAGE_KEYS`` (others dropped), content text ("" for none);
    ``where`` names the column in errors."""
    messages = []
    for i, message in enumerate(without_nulls(value)):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise UserError(f"{where}: message {i} is {str(message)[:80]!r}; give {MESSAGES}")
        message = {k: v for k, v in message.items() if k in MESSAGE_KEYS}
        message["content"] = message.get("content", "")
        if not isinstance(message["content"], str):
            raise UserError(f"{where}: message {i}'s content is {str(message['content'])[:80]!r}; give text")
        assistant = message["role"] == "assistant"
        if "tool_calls" in message and not (assistant and _valid_tool_calls(message["tool_calls"])):
            raise UserError(
                f"{where}: message {i}'s tool_calls = {str(message['tool_calls'])[:80]!r}; an assistant "
                f"message's tool calls are {TOOL_CALLS}"
            )
        if "weight" in message and not (assistant and message["weight"] in (0, 1)):
            raise UserError(
                f"{where}: message {i} ({message['role']}) has weight {message['weight']!r}; an assistant message "
                "may have weight 0 (context, not trained) or 1 (trained, the default)"
            )
        messages.append(message)
    return tuple(messages)


def _valid_tool_calls(calls) -> bool:
    return (
        isinstance(calls, list)
        and bool(calls)
        and all(
            isinstance(c, dict)
            and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", "{}"), (str, dict))
            for c in calls
        )
    )


def tool_list(value, uid: str) -> tuple[dict, ...]:
    """The tools of a row's ``tools`` column (none when it has none)."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise UserError(f"{uid}: column 'tools' is not JSON ({exc}); give {TOOLS}") from None
    else:
        value = without_nulls(value)
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise UserError(f"{uid}: column 'tools' is {type(value).__name__} {str(value)[:80]!r}; give {TOOLS}")
    return tuple(value)


def split_examples(cfg, name: str, rows_of) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples of ``cfg``'s data; ``rows_of(path, key, split)`` reads rows (``read_rows``)."""
    rows = rows_of(cfg.path, "dataset.path", "train")
    train = examples_from_rows(rows, cfg, Path(cfg.path).name or name)
    if cfg.eval_path:
        held_out = examples_from_rows(
            rows_of(cfg.eval_path, "dataset.eval_path", cfg.eval_split), cfg, Path(cfg.eval_path).name
        )
    elif (Path(cfg.path) / "dataset_dict.json").is_file():
        held_out = examples_from_rows(
            rows_of(cfg.path, "dataset.path", cfg.eval_split), cfg, f"{Path(cfg.path).name}/{cfg.eval_split}"
        )
    else:  # hold out a seeded part of the one data set, at most half of it
        train = random.Random(f"{name}-{cfg.seed}").sample(train, len(train))
        n_eval = min(cfg.eval_size, len(train) // 2)
        train, held_out = train[n_eval:], train[:n_eval]
    return train[: cfg.train_size], held_out[: cfg.eval_size]
