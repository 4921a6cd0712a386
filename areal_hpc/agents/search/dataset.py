"""The search agent's data files: questions of the seeded world to train on (``train.jsonl``) and to evaluate
(``test.jsonl``), and the SFT warm-up's demonstrations of the agent's loop (``demos.jsonl``) on other worlds.

    python -m areal_hpc.agents.search.dataset --config configs/agent_search.yaml [key=value ...]
    python -m areal_hpc.agents.search.dataset FOLDER [--seed SEED]

With ``--config``: the files its ``dataset.path``, ``dataset.eval_path`` and ``rl.sft_warmup_path`` name, the
demonstrations replying as its workflow does (``rollout.workflow_args``); with FOLDER: the three files there,
the workflow's defaults. Question rows are ``prompt`` (the question under the tools' instructions), ``answer``,
``question``, ``hops`` and ``path`` (the ids of the pages the hops go through, the last one holding the answer);
demonstrations add ``demo`` (their kind) and ``world`` (their world's seed).

The demonstrations come from other worlds (``DEMO_WORLDS``) than the one trained on and evaluated, so no fact
RL or the evaluation asks about is ever in the warm-up: answering from memory can only guess, and what the
warm-up teaches is the loop itself. A demonstration's ``prompt`` is a conversation, of one of three kinds
(``DEMO_SHARES``, column ``demo``):

- ``search``: the episode the workflow would run for the question: a search for the name the question gives,
  then for each name the result leads to, then ``<answer>``; every model turn is trained;
- ``read``: the same conversation with the first model turn context only (``weight`` 0): it teaches reading
  results and going on, not the choice to search;
- ``direct``: the question and ``<answer>the answer</answer>`` as the ``target``: answering from memory, the
  habit RL has to trade for the tool (as in ``data.calculator``).

Every environment message is what ``SearchAgentWorkflow.respond`` replies to that call on that world, so a
demonstration is, token for token, an episode the workflow can run.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from pathlib import Path

from areal_hpc.agents.search.corpus import Question, build_world, prompt_of, questions
from areal_hpc.agents.search.workflow import SearchAgentWorkflow
from areal_hpc.errors import UserError

# Shares of the demonstrations by kind. Two first turns in seven search (as the calculator's two in seven call
# its tool), so greedy decoding after the warm-up mostly answers from memory while sampling still searches.
DEMO_SHARES = {"search": 0.2, "read": 0.3, "direct": 0.5}
DEMO_WORLDS = 4  # the demonstrations' worlds: the DEMO_WORLDS seeds after the trained world's


def question_row(q: Question) -> dict:
    return {
        "prompt": prompt_of(q.question),
        "answer": q.answer,
        "question": q.question,
        "hops": q.hops,
        "path": list(q.path),
    }


def search_conversation(q: Question, environment: SearchAgentWorkflow) -> list[dict]:
    """The episode that answers ``q`` (a question of ``environment``'s world) by searching: one search per page
    of its path but the last (the title the question or the previous result names), each followed by the
    environment's reply, then the answer."""
    pages = build_world(environment.corpus_seed, environment.named).by_id
    messages = [{"role": "user", "content": prompt_of(q.question)}]
    for page_id in q.path[:-1]:
        call = ("search", pages[page_id].title)
        messages += [
            {"role": "assistant", "content": f"<search>{call[1]}</search>"},
            {"role": environment.observation_role, "content": environment.respond(call)},
        ]
    return [*messages, {"role": "assistant", "content": f"<answer>{q.answer}</answer>"}]


def demonstration(q: Question, kind: str, environment: SearchAgentWorkflow) -> dict:
    """``q``'s demonstration of ``kind`` (``search``, ``read`` or ``direct``) on ``environment``'s world."""
    row = {k: v for k, v in question_row(q).items() if k != "prompt"} | {"demo": kind, "world": environment.corpus_seed}
    if kind == "direct":
        opening = [{"role": "user", "content": prompt_of(q.question)}]
        return {"prompt": opening, "target": f"<answer>{q.answer}</answer>", **row}
    if kind not in ("search", "read"):
        raise ValueError(f"unknown demonstration kind {kind!r}")
    messages = search_conversation(q, environment)
    if kind == "read":
        messages[1] = {**messages[1], "weight": 0}
    return {"prompt": messages, "target": "", **row}


def rows(seed: int = 0, test_fraction: float = 0.2, named: bool = True) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows) of the world of ``seed`` (``named``: ``corpus.build_world``): every question once,
    split by a seeded shuffle."""
    order = list(questions(seed, named))
    random.Random(f"areal-hpc-search-split-{seed}").shuffle(order)
    table = [question_row(q) for q in order]
    n_test = max(1, round(len(table) * test_fraction))
    return table[n_test:], table[:n_test]


def demonstrations(environment: SearchAgentWorkflow, shares: dict[str, float] = DEMO_SHARES) -> list[dict]:
    """Every question of the ``DEMO_WORLDS`` worlds after ``environment``'s as a demonstration, of a kind drawn
    with ``shares`` (seeded), replying as ``environment`` does on its world."""
    first = environment.corpus_seed + 1
    rng = random.Random(f"areal-hpc-search-demos-{first}")
    kinds, weights = list(shares), list(shares.values())
    table = []
    for world in range(first, first + DEMO_WORLDS):
        on_world = replace_world(environment, world)
        table += [demonstration(q, rng.choices(kinds, weights)[0], on_world) for q in questions(world, on_world.named)]
    rng.shuffle(table)
    return table


def replace_world(environment: SearchAgentWorkflow, world: int) -> SearchAgentWorkflow:
    """``environment``'s settings on the world of seed ``world``."""
    on_world = copy.copy(environment)
    on_world.corpus_seed = world
    return on_world


def write_rows(paths: tuple[Path, Path, Path], environment: SearchAgentWorkflow, test_fraction: float = 0.2) -> None:
    """Write the train, test and demonstration rows of ``environment``'s world into ``paths`` (folders created)."""
    train, test = rows(environment.corpus_seed, test_fraction, environment.named)
    for path, table in zip(paths, (train, test, demonstrations(environment))):
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(path.name + ".partial")
        staging.write_text("".join(json.dumps(row) + "\n" for row in table))
        staging.replace(path)  # readers never see half a file


def write_dataset(folder: str | Path, seed: int = 0, **settings) -> tuple[Path, Path, Path]:
    """Write ``train.jsonl``, ``test.jsonl`` and ``demos.jsonl`` into ``folder``; returns their paths.
    ``settings``: the search workflow's (``top_k``, ``snippet_chars``, ...) that the demonstrations follow."""
    folder = Path(folder)
    paths = folder / "train.jsonl", folder / "test.jsonl", folder / "demos.jsonl"
    write_rows(paths, SearchAgentWorkflow(corpus_seed=seed, **settings))
    return paths


def write_for_config(config: str, overrides: list[str]) -> tuple[Path, Path, Path]:
    """Write the files a run's config reads (``dataset.path``, ``dataset.eval_path``, ``rl.sft_warmup_path``),
    the demonstrations replying as the config's search workflow does (``rollout.workflow_args``)."""
    from areal_hpc.agents.registry import build_workflow
    from areal_hpc.config import load_config

    cfg = load_config(config, overrides)
    environment = build_workflow(cfg.rollout)
    paths = cfg.dataset.path, cfg.dataset.eval_path, cfg.rl.sft_warmup_path
    if not isinstance(environment, SearchAgentWorkflow) or not all(paths):
        raise UserError(
            f"{config}: writing the search agent's data needs rollout.workflow: search, dataset.path, "
            "dataset.eval_path and rl.sft_warmup_path"
        )
    files = (Path(paths[0]), Path(paths[1]), Path(paths[2]))
    write_rows(files, environment)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal_hpc.agents.search.dataset",
        description="Write the search agent's train.jsonl, test.jsonl and demos.jsonl (SFT demonstrations).",
    )
    parser.add_argument("folder", nargs="?", help="write the three files into FOLDER (the workflow's defaults)")
    parser.add_argument("--seed", type=int, default=0, help="the world's seed (with FOLDER)")
    parser.add_argument("--config", help="instead: the files CONFIG names, replying as its workflow does")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of CONFIG")
    args = parser.parse_args(argv)
    try:
        if args.config:  # argparse hands the first key=value to ``folder``
            written = write_for_config(args.config, [*filter(None, [args.folder]), *args.overrides])
        elif args.folder and not args.overrides:
            written = write_dataset(args.folder, args.seed)
        else:
            parser.error("give FOLDER, or --config CONFIG [key=value ...]")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
