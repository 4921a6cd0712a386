"""Preference pairs from your files for DPO and reward modelling: a prompt with a chosen and a rejected
completion, read like any dataset (``data.user_data``: JSONL, Parquet, Arrow, a glob or folder of them, a
``save_to_disk`` folder) from ``preference.path``, held out from ``preference.eval_path`` or by seed.

Two row shapes:
- ``{"prompt": text or messages, "chosen": text, "rejected": text}`` (column names from ``preference.*_field``);
- conversations, as in Anthropic HH-RLHF: ``chosen`` and ``rejected`` are whole chat transcripts
  (``[{"role", "content"}, ...]``) that share every turn before the last assistant turn; that shared
  part is the prompt and each last turn a completion.

The prompt is rendered by the model's chat template and each completion closed with the end-of-turn
token (``models.chat``), as the policy generates them. A pair with a missing side, two identical sides
or more tokens than ``max_tokens`` is dropped and counted, in one line; none left is an error. Held-out
pairs whose prompt a training pair asks too are counted in a line of their own: a task that repeats its
problems (the quickstart's 20,000 prompts are 6,095 problems) makes such a held-out set a test of memory.

``pairs_from_episodes`` makes pairs from a model's own samples (``areal-hpc pairs``): per prompt, its
best-rewarded completion against its worst, or every completion against every one rewarded lower
(``--pairing all``), where the rewards differ.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from areal_hpc.config import DatasetConfig, PreferenceConfig
from areal_hpc.data.tasks import Example
from areal_hpc.data.user_data import read_rows, split_examples
from areal_hpc.errors import UserError
from areal_hpc.models.chat import completion_ids, example_prompt_ids


@dataclass(frozen=True)
class PreferencePair:
    uid: str
    prompt_ids: list[int]
    chosen_ids: list[int]  # the completion tokens, closed by the end-of-turn token
    rejected_ids: list[int]

    def sequences(self) -> list[tuple[list[int], list[int]]]:
        """(tokens, loss mask) of prompt + chosen and prompt + rejected: the mask is 1 on the completion."""
        prompt = [0] * len(self.prompt_ids)
        return [(self.prompt_ids + side, prompt + [1] * len(side)) for side in (self.chosen_ids, self.rejected_ids)]


def _is_chat(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def split_conversations(row: dict, chosen: str, rejected: str, prompt: str) -> dict:
    """A row whose two sides are whole transcripts as a prompt (the shared turns) and two completion texts;
    any other row as it is."""
    sides = row.get(chosen), row.get(rejected)
    if not (_is_chat(sides[0]) and _is_chat(sides[1])):
        return row
    shared, last = sides[0][:-1], [side[-1] for side in sides]
    if sides[1][:-1] != shared or any(m["role"] != "assistant" for m in last):
        return {**row, chosen: None, rejected: None}  # not a pair of answers to one conversation: dropped
    return {
        **row,
        prompt: [{"role": m["role"], "content": m["content"]} for m in shared],
        chosen: last[0]["content"],
        rejected: last[1]["content"],
    }


def load_pairs(
    cfg: PreferenceConfig, seed: int, tokenizer, max_tokens: int, say=print
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out) pairs of ``cfg`` that fit in ``max_tokens`` (prompt + the longer side)."""
    if not cfg.path:
        raise UserError(
            "config key 'preference.path' is empty: give your pairs (a JSONL, Parquet or Arrow file "
            "with prompt, chosen and rejected columns, or chosen/rejected conversations)"
        )
    prompt_key = cfg.prompt_field or "prompt"

    def rows_of(path: str, key: str, split: str) -> list[dict]:
        rows = read_rows(path, key.replace("dataset.", "preference."), split)
        rows = [split_conversations(row, cfg.chosen_field, cfg.rejected_field, prompt_key) for row in rows]
        for key, column in (("chosen_field", cfg.chosen_field), ("rejected_field", cfg.rejected_field)):
            if rows and column not in rows[0]:
                raise UserError(
                    f"config key 'preference.{key}': {path} has no column {column!r}; its columns are "
                    f"{', '.join(rows[0])}"
                )
        return rows

    data = DatasetConfig(
        path=cfg.path,
        eval_path=cfg.eval_path,
        prompt_field=prompt_key,
        answer_field="",
        target_field="",
        seed=seed,
        train_size=cfg.train_size,
        eval_size=cfg.eval_size,
    )
    try:
        train, held_out = split_examples(data, "pairs", rows_of)
    except UserError as exc:
        raise UserError(str(exc).replace("'dataset.", "'preference.")) from None
    pairs = []
    for name, examples in (("training", train), ("held-out", held_out)):
        kept, dropped = _tokenized(examples, cfg, tokenizer, max_tokens)
        if dropped:
            say(
                f"dropped {sum(map(len, dropped.values()))} {name} pairs: "
                + "; ".join(f"{len(uids)} {reason} (first: {uids[0]})" for reason, uids in dropped.items())
            )
        pairs.append(kept)
    if not pairs[0]:
        raise UserError(f"preference.path {cfg.path}: no usable training pair (see the line above)")
    asked = {tuple(pair.prompt_ids) for pair in pairs[0]}
    seen = sum(tuple(pair.prompt_ids) in asked for pair in pairs[1])
    if seen:
        say(
            f"{seen} of {len(pairs[1])} held-out pairs ask a prompt that training pairs ask too: their accuracy "
            "partly measures memory; hold out other prompts with preference.eval_path (areal-hpc pairs --split eval)"
        )
    return pairs[0], pairs[1]


def _tokenized(
    examples: list[Example], cfg: PreferenceConfig, tokenizer, max_tokens: int
) -> tuple[list[PreferencePair], dict[str, list[str]]]:
    kept, dropped = [], {}
    for ex in examples:
        chosen, rejected = ex.fields.get(cfg.chosen_field), ex.fields.get(cfg.rejected_field)
        if not isinstance(chosen, str) or not isinstance(rejected, str) or not chosen or not rejected:
            dropped.setdefault("with a missing side", []).append(ex.uid)
            continue
        if chosen == rejected:
            dropped.setdefault("with identical sides", []).append(ex.uid)
            continue
        prompt = example_prompt_ids(tokenizer, replace(ex, fields={}))
        sides = completion_ids(tokenizer, chosen), completion_ids(tokenizer, rejected)
        if len(prompt) + max(map(len, sides)) > max_tokens:
            dropped.setdefault(f"longer than {max_tokens} tokens", []).append(ex.uid)
            continue
        kept.append(PreferencePair(ex.uid, prompt, *sides))
    return kept, dropped


PAIRINGS = ("best-worst", "all")


def pairs_from_episodes(episodes: list[dict], n_samples: int, pairing: str = "best-worst") -> list[dict]:
    """Rows {prompt, chosen, rejected, answer, chosen_reward, rejected_reward} from ``n_samples`` consecutive
    episodes per prompt (``train.evaluate`` rows), for the prompts whose rewards differ: ``best-worst``, the
    first best-rewarded completion against the first worst-rewarded one; ``all``, every distinct completion
    against every distinct one rewarded lower (the near misses as well as the worst)."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r}; valid: {', '.join(PAIRINGS)}")
    rows = []
    for start in range(0, len(episodes) - n_samples + 1, n_samples):
        group = [e for e in episodes[start : start + n_samples] if "error" not in e]
        if not group:
            continue
        if pairing == "all":
            distinct: dict[str, dict] = {}
            for episode in group:  # each text once: its first episode
                distinct.setdefault(episode["completion"], episode)
            ordered = [(a, b) for a in distinct.values() for b in distinct.values() if a["reward"] > b["reward"]]
        else:
            best, worst = max(group, key=lambda e: e["reward"]), min(group, key=lambda e: e["reward"])
            ordered = [(best, worst)] if best["reward"] > worst["reward"] else []
        rows += [
            {
                "prompt": best["prompt"],
                "chosen": best["completion"],
                "rejected": worst["completion"],
                "answer": best.get("answer", ""),
                "chosen_reward": best["reward"],
                "rejected_reward": worst["reward"],
            }
            for best, worst in ordered
            if best["completion"] != worst["completion"]
        ]
    return rows
