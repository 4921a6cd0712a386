"""The search agent (ASearcher style): its generated corpus and questions, the BM25 index, the exact
match / F1 reward, the tool-call parser on hostile text, a scripted agent that answers by following a
question's hops, and the tiny model through a real embedded rollout server for more than 10 turns,
whose record is exact token for token; then a short `areal-hpc train` run of the workflow."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from pathlib import Path

import pytest
import torch
from bm25s.stopwords import STOPWORDS_EN
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, Sampling, Scorer
from areal_hpc.agents.groups import run_episode
from areal_hpc.agents.registry import build_workflow
from areal_hpc.agents.search import dataset
from areal_hpc.agents.search.corpus import build_world, prompt_of
from areal_hpc.agents.search.dataset import DEMO_WORLDS, demonstrations, replace_world, rows, write_dataset
from areal_hpc.agents.search.index import PAGE_CHARS, SNIPPET_CHARS, clip, get_index
from areal_hpc.agents.search.reward import exact_match_f1, extract_answer, normalize_answer, token_f1
from areal_hpc.agents.search.workflow import NO_TOOL_CALL, SearchAgentWorkflow, echo, parse_action
from areal_hpc.config import DatasetConfig, RewardConfig, RolloutConfig, load_config
from areal_hpc.data.registry import build_task
from areal_hpc.data.rewards import RewardPool, RewardRequest
from areal_hpc.data.tasks import Example
from areal_hpc.data.user_data import examples_from_rows
from areal_hpc.errors import UserError
from areal_hpc.fsio import read_json_lines
from areal_hpc.models.chat import next_turn_ids
from areal_hpc.models.hf import load_model, load_tokenizer
from areal_hpc.rollout.client import Generation, RolloutClient
from areal_hpc.train.sft import sft_sequences
from tests.conftest import embedded_server, run_cli

REWARD_FN = "areal_hpc.agents.search.reward:exact_match_f1"
# sha256 of the seed-0 world (pages and questions): the same on every machine; a change to the generator
# changes every data set written with it (update this then, on purpose)
WORLD_SHA256 = "6e6a89597f6d48cf87e865d905ab29293f31444b557b0200d0252f4ca26f3d7d"


def world_digest(world) -> str:
    text = json.dumps(
        [
            [[p.id, p.title, p.text] for p in world.pages],
            [[q.question, q.answer, q.hops, list(q.path)] for q in world.questions],
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture(scope="module")
def pool():
    with RewardPool(REWARD_FN) as rewards:
        yield rewards


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def example_of(question, uid: str = "q0") -> Example:
    return Example(
        uid,
        prompt_of(question.question),
        answer=question.answer,
        fields={"question": question.question, "hops": question.hops, "path": list(question.path)},
    )


# --- corpus and questions --------------------------------------------------------------------------------


def test_the_world_of_a_seed_is_always_the_same_and_made_in_well_under_a_second():
    build_world.cache_clear()
    start = time.perf_counter()
    world = build_world(0)
    took = time.perf_counter() - start
    assert took < 1.0
    build_world.cache_clear()
    assert build_world(0) == world and world_digest(world) == WORLD_SHA256
    assert build_world(1).pages != world.pages
    kinds = [p.id.split("-")[0] for p in world.pages]
    assert {k: kinds.count(k) for k in set(kinds)} == {"country": 10, "city": 40, "person": 150, "company": 60}
    assert len({p.id for p in world.pages}) == len({p.title for p in world.pages}) == len(world.pages) == 260
    # every made-up word names one thing, is no stop word (BM25 drops those) and no word of the page texts
    name_words = [w.lower() for p in world.pages for w in p.title.split()[: 1 if p.id.startswith("company") else 2]]
    assert len(set(name_words)) == len(name_words)
    template_words = (
        {w.lower() for p in world.pages for w in re.findall(r"\w+", p.text)}
        - set(name_words)
        - {w.lower() for p in world.pages for w in p.title.split()}
    )
    assert not set(name_words) & (set(STOPWORDS_EN) | template_words)
    hops = [q.hops for q in world.questions]
    assert len(world.questions) == 460 and {h: hops.count(h) for h in set(hops)} == {1: 190, 2: 210, 3: 60}
    assert all(q.question.endswith(f"{world.by_id[q.path[0]].title}?") for q in world.questions)
    train, test = rows(0)
    assert (len(train), len(test)) == (368, 92) and rows(0) == (train, test)
    assert not {r["question"] for r in train} & {r["question"] for r in test}


@pytest.mark.parametrize("named", [True, False])
def test_every_answer_is_reached_by_searching_and_opening_the_pages_of_its_hops(named):
    """Search the entity the question names: its page is the top hit, and the result's snippet ends with the
    next entity (the name to search next is the last one read); open it: it names the next entity; ... the
    last page's title is the answer, and no other page has that title."""
    world, index = build_world(0, named), get_index(0, named)
    titles = [p.title for p in world.pages]
    for q in world.questions:
        name = world.by_id[q.path[0]].title
        assert q.question.endswith(f"{name}?")
        for here, there in zip(q.path, q.path[1:] + (None,)):
            hits = index.search(name, k=3)
            assert hits[0][0] == here, (q.question, name, hits)
            if there is not None:
                name = world.by_id[there].title
                assert name in index.open_page(here) and hits[0][2].endswith(f" {name}."), hits[0]
        assert name == q.answer and titles.count(q.answer) == 1


def test_the_data_command_refuses_a_config_that_names_no_search_files_in_one_line(capsys, tmp_path):
    assert dataset.main(["--config", "configs/quickstart.yaml", f"cluster.fileroot={tmp_path}"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: configs/quickstart.yaml: writing the search agent's data needs rollout.workflow: ")
    assert error.count("\n") == 1 and not any(tmp_path.iterdir())
    with pytest.raises(SystemExit) as usage:
        dataset.main([])
    assert usage.value.code == 2 and "give FOLDER, or --config CONFIG" in capsys.readouterr().err


def test_the_written_files_are_a_custom_task_scored_by_exact_match(tmp_path):
    train_path, test_path, demos_path = write_dataset(tmp_path / "data")
    assert [r["question"] for r in read_json_lines(train_path)] == [r["question"] for r in rows(0)[0]]
    assert read_json_lines(demos_path) == demonstrations(SearchAgentWorkflow())
    task = build_task(
        DatasetConfig(task="custom", path=str(train_path), eval_path=str(test_path)), RewardConfig(fn=REWARD_FN)
    )
    assert (len(task.train), len(task.eval)) == (368, 92)
    example = task.eval[0]
    assert example.prompt == prompt_of(example.fields["question"]) and example.fields["hops"] in (1, 2, 3)
    assert example.fields["path"][-1].startswith(("city-", "country-"))
    request = RewardRequest(
        example.prompt, f"<answer> {example.answer.upper()}. </answer>", [], [], example.reward_fields()
    )
    assert task.reward(request) == (1.0, {"f1": 1.0})


# --- the index -------------------------------------------------------------------------------------------


def test_search_returns_bounded_snippets_of_the_best_pages_and_open_page_bounded_text():
    world, index = build_world(0), get_index(0)
    city = next(p for p in world.pages if p.id == "city-07")
    hits = index.search(f"{city.title} city", k=3)
    assert hits[0] == (city.id, city.title, clip(city.text, SNIPPET_CHARS))
    assert 1 <= len(hits) <= 3 and all(len(snippet) <= SNIPPET_CHARS for _, _, snippet in hits)
    assert len(index.search("is a company founded", k=1000)) <= len(world.pages)
    assert index.search("zzqxv wwkq", k=3) == [] and index.search("", k=3) == [] and index.search("the of", 3) == []
    assert index.search(city.title, k=0) == []
    assert index.search(city.title, k=1, snippet_chars=20)[0][2].endswith("...")
    assert (
        index.open_page(" [CITY-07] ").startswith(city.title)
        and index.open_page("city-07") == f"{city.title}\n{city.text}"
    )
    assert len(index.open_page("country-00", max_chars=40)) <= 40 and len(index.open_page("country-00")) <= PAGE_CHARS
    with pytest.raises(KeyError):
        index.open_page("city-99")


@settings(max_examples=200, deadline=None)
@given(query=st.text(max_size=600), k=st.integers(-3, 400))
def test_any_query_is_answered_without_raising(query, k):
    hits = get_index(0).search(query, k)
    assert len(hits) <= max(k, 0) and all(isinstance(h, tuple) and len(h) == 3 for h in hits)


# --- the reward ------------------------------------------------------------------------------------------


def test_the_reward_normalises_like_squad_and_reads_the_answer_tag():
    assert normalize_answer("  The  Dosebond-Republic, an   island! ") == "dosebondrepublic island"
    assert exact_match_f1("", "<answer>the Barur.</answer>", [], [], answer="Barur") == {"reward": 1.0, "f1": 1.0}
    assert exact_match_f1("", "I think <answer>Barur Kingdom</answer>", [], [], answer="Barur") == {
        "reward": 0.0,
        "f1": pytest.approx(2 / 3),
    }
    assert exact_match_f1("", "<answer>x</answer> <answer>Barur</answer>", [], [], answer="Barur")["reward"] == 0.0
    assert exact_match_f1("", "Barur", [], [], answer="barur")["reward"] == 1.0  # no tag: the whole completion
    assert extract_answer("<answer>Barur") == "<answer>Barur" and extract_answer(None) == ""
    assert exact_match_f1("", "<answer>Koglos</answer>", [], [], answer=["Barur", "koglos"])["reward"] == 1.0
    assert exact_match_f1("", "", [], [], answer="Barur") == {"reward": 0.0, "f1": 0.0}


words = st.text(alphabet=st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(
    answer=st.lists(words, min_size=1, max_size=4).map(" ".join),
    article=st.sampled_from(["", "the ", "A ", "an "]),
    punctuation=st.text(alphabet=".,!?;:'\"", max_size=3),
    upper=st.booleans(),
    pad=st.integers(0, 3),
)
def test_case_punctuation_articles_and_spacing_never_change_the_score(answer, article, punctuation, upper, pad):
    written = " " * pad + article + (answer.upper() if upper else answer) + punctuation + " " * pad
    score = exact_match_f1("", f"<answer>{written}</answer>", [], [], answer=answer)
    if normalize_answer(answer):  # an answer of articles alone normalises to nothing
        assert score == {"reward": 1.0, "f1": 1.0}
    assert normalize_answer(normalize_answer(written)) == normalize_answer(written)


@settings(max_examples=300, deadline=None)
@given(prediction=st.text(max_size=60), truth=st.text(max_size=60))
def test_exact_match_is_0_or_1_and_implies_f1_1_and_f1_is_symmetric(prediction, truth):
    score = exact_match_f1("", prediction, [], [], answer=truth)
    assert score["reward"] in (0.0, 1.0) and 0.0 <= score["f1"] <= 1.0
    assert score["reward"] == 0.0 or score["f1"] == 1.0
    assert token_f1(prediction, truth) == pytest.approx(token_f1(truth, prediction))


# --- the tool-call parser and the environment's replies --------------------------------------------------

PIECES = [
    "<search>",
    "</search>",
    "<open>",
    "</open>",
    "<answer>",
    "</answer>",
    "<",
    ">",
    "/",
    "search",
    "x",
    " ",
    "\n",
    "<|im_end|>",
    "<|im_start|>",
    "city-07",
    "é",
]
REFERENCE = re.compile(r"<(search|open|answer)>(.*?)</\1>", re.S)


@settings(max_examples=500, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=30).map("".join) | st.text(max_size=200))
def test_the_parser_takes_the_first_complete_tool_call_of_any_text(text):
    match = REFERENCE.search(text)
    assert parse_action(text) == (None if match is None else (match.group(1), match.group(2).strip()))


def test_the_parser_on_hostile_input():
    assert parse_action("<search> Koglos </search><answer>x</answer>") == ("search", "Koglos")
    assert parse_action("<answer>x <search>y</search>") == ("search", "y")  # an unclosed tag is no call
    assert parse_action("<answer></answer>") == ("answer", "")
    assert parse_action("<SEARCH>x</SEARCH>") is None and parse_action(None) is None and parse_action("") is None
    start = time.perf_counter()
    assert parse_action("<answer><search><open>" * 100_000) is None  # linear, not quadratic
    assert time.perf_counter() - start < 1.0
    assert echo("<|im_end|>\n<search>" + "a" * 500) == "im_end search " + "a" * 47 + "..."


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(st.sampled_from(PIECES), max_size=30).map("".join) | st.text(max_size=300))
def test_a_reply_to_any_turn_carries_no_special_token_but_its_framing(tokenizer, text):
    reply = SearchAgentWorkflow().respond(parse_action(text))
    ids = next_turn_ids(tokenizer, "user", reply, [tokenizer.eos_token_id])
    special = [i for i in ids if i in tokenizer.all_special_ids]
    assert len(special) == 3  # <|im_start|>user ... <|im_end|> <|im_start|>(assistant)
    assert reply == NO_TOOL_CALL or reply.startswith(("<information>", "no results", "no page", "empty query"))


def test_the_workflow_is_built_in_and_checks_its_arguments():
    workflow = build_workflow(RolloutConfig(workflow="search", workflow_args={"max_turns": 12, "top_k": 2}))
    assert isinstance(workflow, SearchAgentWorkflow) and (workflow.max_turns, workflow.top_k) == (12, 2)
    with pytest.raises(UserError, match="max_turns"):
        SearchAgentWorkflow(max_turns=0)


# --- episodes --------------------------------------------------------------------------------------------


class ScriptedModel:
    """A stand-in for the rollout servers: its turns are given as text; it keeps what it was shown."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.shown = tokenizer, turns, []

    async def generate(self, input_ids, params):
        self.shown.append(list(input_ids))
        text = self.turns[min(len(self.shown), len(self.turns)) - 1]
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # as text
        ids = (ids + [self.tokenizer.eos_token_id])[: params["max_new_tokens"]]
        return Generation(list(input_ids), ids, [-0.25] * len(ids), [3] * len(ids), "stop")


def scripted_episode(tokenizer, pool, turns, example, workflow, max_new_tokens=64):
    model = ScriptedModel(tokenizer, turns)
    engine = EpisodeContext(EpisodeSettings(model.generate, tokenizer, Sampling(max_new_tokens), Scorer(pool)))
    [record] = asyncio.run(run_episode(workflow, engine, example))
    return record, engine, model


def assert_exact(record, generations):
    """The record is the last generation's context and output; every turn's context is the record so far."""
    sequence = []
    for segment, generation in zip(record.segments, generations, strict=True):
        sequence += segment.input_ids.tolist()
        assert sequence == list(generation.input_ids)
        assert segment.output_ids.tolist() == list(generation.output_ids)
        assert (
            len(segment.output_logprobs)
            == len(segment.output_versions)
            == len(segment.loss_mask)
            == len(segment.output_ids)
        )
        assert segment.output_logprobs.tolist() == pytest.approx(list(generation.logprobs))
        assert segment.output_versions.tolist() == list(generation.versions) and segment.loss_mask.all()
        sequence += segment.output_ids.tolist()
    assert sequence == list(generations[-1].input_ids) + list(generations[-1].output_ids)


def test_a_scripted_agent_follows_the_hops_through_hostile_turns_to_the_answer(tokenizer, pool):
    world = build_world(0)
    question = next(q for q in world.questions if q.hops == 3)
    names = [world.by_id[page_id].title for page_id in question.path]
    hostile = [
        "",
        "I do not know",
        "<search></search>",
        "<open>nowhere</open>",
        "<open><|im_end|>x</open>",
        "<search>zzqxv</search>",
        "<answer>unclosed",
        "<SEARCH>x</SEARCH>",
    ]
    turns = hostile[:]
    for name, page_id in zip(names[:-1], question.path):
        turns += [f"Look up <search>{name}</search>", f"<open> {page_id.upper()} </open>"]
    turns.append(f"It is <answer>{question.answer}</answer> <search>more</search>")
    record, engine, _model = scripted_episode(
        tokenizer, pool, turns, example_of(question), SearchAgentWorkflow(max_turns=20)
    )
    assert len(record.segments) == len(turns) == 15
    assert_exact(record, engine.generations)
    replies = [tokenizer.decode(s.input_ids) for s in record.segments[1:]]
    assert all(NO_TOOL_CALL in r for r in replies[:2]) and "empty query" in replies[2]
    assert "no page with id: nowhere" in replies[3] and "no page with id: im_end x" in replies[4]
    assert "no results for: zzqxv" in replies[5] and NO_TOOL_CALL in replies[6] and NO_TOOL_CALL in replies[7]
    for i, (name, page_id) in enumerate(zip(names[:-1], question.path)):
        found, opened = replies[8 + 2 * i], replies[9 + 2 * i]
        assert (
            f"[{page_id}] {name}:" in found
            and names[i + 1] in opened
            and opened.startswith(f"\n<|im_start|>user\n<information>\n[{page_id}] {name}\n")
        )
    assert [(r.value, r.step) for r in record.rewards] == [(1.0, 14)]
    assert engine.outcomes[0].metrics == {"f1": 1.0} and record.metadata["reward_metrics"] == {"f1": 1.0}
    assert {k: record.metadata[k] for k in ("search_calls", "open_calls", "invalid_calls", "answered")} == {
        "search_calls": 5,
        "open_calls": 5,
        "invalid_calls": 4,
        "answered": True,
    }


@pytest.mark.parametrize(("top_k", "named"), [(1, False), (3, True)])
def test_every_demonstration_is_token_for_token_an_episode_the_workflow_runs_and_scores_1(
    tokenizer, pool, top_k, named
):
    """The SFT warm-up's rows, rendered as SFT renders them (the chat template, the proxy's renderer for the
    multi-turn ones), equal the episode the workflow records on the row's world when a model says the
    demonstration's turns: the same tokens, the same trained tokens (a ``read`` row's first turn is context
    only), reward 1."""
    workflow = SearchAgentWorkflow(top_k=top_k, max_turns=4, named=named)
    demos = demonstrations(workflow)
    examples = examples_from_rows(demos, DatasetConfig(task="custom"), "demos")
    assert {r["demo"] for r in demos} == {"search", "read", "direct"}
    assert {r["world"] for r in demos} == set(range(1, 1 + DEMO_WORLDS)) and len(demos) == 460 * DEMO_WORLDS
    for row, example in list(zip(demos, examples))[:40]:
        [(ids, mask)] = sft_sequences(tokenizer, example)
        turns = [m["content"] for m in example.messages if m["role"] == "assistant"] or [example.target]
        assert example.prompt == "" and example.opening_messages() == [
            {"role": "user", "content": prompt_of(row["question"])}
        ]
        record, _, _ = scripted_episode(tokenizer, pool, turns, example, replace_world(workflow, row["world"]))
        sequence = [t for s in record.segments for t in [*s.input_ids.tolist(), *s.output_ids.tolist()]]
        trained = [m for s in record.segments for m in [0] * len(s.input_ids) + [1] * len(s.output_ids)]
        if row["demo"] == "read":
            first = len(record.segments[0].input_ids)
            trained[first : first + len(record.segments[0].output_ids)] = [0] * len(record.segments[0].output_ids)
        assert (sequence, trained) == (ids, mask), row["demo"]
        assert len(turns) == (1 if row["demo"] == "direct" else row["hops"] + 1) and record.rewards[-1].value == 1.0


def test_the_world_called_by_page_ids_is_the_named_world_with_each_name_replaced_by_its_page_id():
    named, by_id = build_world(3), build_world(3, named=False)
    longest_first = sorted(named.pages, key=lambda p: -len(p.title))
    for page, twin in zip(named.pages, by_id.pages, strict=True):
        text = page.text
        for other in longest_first:
            text = text.replace(other.title, other.id)
        assert (twin.id, twin.title, twin.text) == (page.id, page.id, text)
    for q, twin in zip(named.questions, by_id.questions, strict=True):
        assert (twin.path, twin.hops, twin.answer) == (q.path, q.hops, q.path[-1])


def test_no_fact_of_the_trained_world_is_in_the_demonstrations():
    """The demonstrations' worlds share no name with the world RL trains and evaluates on; called by page ids
    they share the names (the ids), and a question's answer is the same only by chance."""
    names = {p.title for p in build_world(0).pages}
    facts = {(q.question, q.answer) for q in build_world(0, named=False).questions}
    for world in range(1, 1 + DEMO_WORLDS):
        assert not names & {p.title for p in build_world(world).pages}
        shared = facts & {(q.question, q.answer) for q in build_world(world, named=False).questions}
        assert len(shared) / len(facts) < 0.1


def test_an_episode_that_never_answers_or_runs_out_of_context_is_scored_0(tokenizer, pool):
    question = build_world(0).questions[5]
    record, engine, _ = scripted_episode(
        tokenizer, pool, ["Barur"], example_of(question), SearchAgentWorkflow(max_turns=4)
    )
    assert len(record.segments) == 4 and [(r.value, r.step) for r in record.rewards] == [(0.0, 3)]
    assert record.metadata["answered"] is False and record.metadata["invalid_calls"] == 4
    assert_exact(record, engine.generations)
    # the context budget ends the episode before a turn that could overflow it
    limit = len(engine.generations[2].input_ids) + 64
    record, engine, _ = scripted_episode(
        tokenizer, pool, ["Barur"], example_of(question), SearchAgentWorkflow(max_turns=10, max_context_tokens=limit)
    )
    assert len(record.segments) == 3 and record.metadata["ended_by_context"] is True
    assert all(len(g.input_ids) + 64 <= limit for g in engine.generations)
    assert_exact(record, engine.generations)


@torch.no_grad()
def teacher_forced(model_dir: Path, ids: list[int]) -> list[float]:
    """Logprob of each token after the ones before it (temperature 1); entry i is token i + 1's."""
    model = load_model(model_dir).eval()
    logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_the_tiny_model_runs_12_turns_on_a_real_server_and_its_record_is_exact(
    tiny_model_dir, tokenizer, pool, tmp_path
):
    """An untrained model never calls a tool: every turn gets the format message and the episode runs
    to max_turns. Concatenating the segments gives exactly the last generation's context and output;
    the environment's tokens are all in input_ids, the model's in output_ids with one logprob (the
    model's own, teacher-forced over the whole record) and one version each."""
    question = next(q for q in build_world(0).questions if q.hops == 3)
    workflow = SearchAgentWorkflow(max_turns=12, top_k=2, max_context_tokens=1024)

    async def run(address):
        async with RolloutClient([address]) as client:
            engine = EpisodeContext(
                EpisodeSettings(client.generate, tokenizer, Sampling(max_new_tokens=6), Scorer(pool))
            )
            [record] = await run_episode(workflow, engine, example_of(question))
            return record, engine

    with embedded_server(tiny_model_dir, tmp_path) as (_, address):
        record, engine = asyncio.run(run(address))
    assert len(record.segments) == len(engine.generations) == 12 and record.metadata["answered"] is False
    assert_exact(record, engine.generations)
    prompt = engine.prompt_ids(example_of(question))
    assert record.segments[0].input_ids.tolist() == prompt
    for before, segment in zip(record.segments, record.segments[1:]):  # the environment's tokens: its replies
        assert segment.input_ids.tolist() == next_turn_ids(tokenizer, "user", NO_TOOL_CALL, before.output_ids.tolist())
    assert all(set(s.output_versions.tolist()) == {0} and len(s.output_ids) >= 1 for s in record.segments)
    sequence = [t for s in record.segments for t in s.input_ids.tolist() + s.output_ids.tolist()]
    assert len(sequence) <= 1024
    expected, position, got, want = teacher_forced(tiny_model_dir, sequence), 0, [], []
    for segment in record.segments:
        position += len(segment.input_ids)
        got += segment.output_logprobs.tolist()
        want += expected[position - 1 : position - 1 + len(segment.output_ids)]
        position += len(segment.output_ids)
    assert got == pytest.approx(want, abs=2e-3)
    assert [(r.value, r.step) for r in record.rewards] == [(0.0, 11)] and engine.outcomes[0].metrics == {"f1": 0.0}


@pytest.mark.slow
def test_a_short_training_run_of_the_search_agent_runs_more_than_10_turns_an_episode(tiny_model_dir, tmp_path):
    """The config's data is written by its command; the warm-up trains on the demonstrations
    (rl.sft_warmup_path), not the RL questions; then RL runs episodes of more than 10 turns (the warm-up is 2
    steps: the model still never answers)."""
    data = tmp_path / "data"
    demos_path = data / "demos.jsonl"
    paths = [f"dataset.path={data / 'train.jsonl'}", f"dataset.eval_path={data / 'test.jsonl'}"]
    paths.append(f"rl.sft_warmup_path={demos_path}")
    assert dataset.main(["--config", "configs/agent_search.yaml", *paths]) == 0
    result = run_cli(
        "train",
        "--config",
        "configs/agent_search.yaml",
        f"model.path={tiny_model_dir}",
        f"cluster.fileroot={tmp_path}",
        *paths,
        "rl.total_train_steps=2",
        "rl.eval_every_steps=0",
        "dataset.eval_size=1",
        "generation.n_samples=2",
        "rollout.consumer_batch_size=2",
        "rollout.max_concurrent_rollouts=2",
        "generation.max_new_tokens=4",
        "rl.sft_warmup_steps=2",
        "sft.batch_size=2",
        "rollout.workflow_args.max_turns=12",
        "stats.tensorboard=false",
        "stats.plot=false",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_json_lines(tmp_path / "agent_search" / "trial0" / "metrics.jsonl")
    steps = [r for r in records if "rollout/turns" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["rollout/turns"] > 10 and r["rollout/failures_total"] == 0 and "reward/f1" in r for r in steps)
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2]
    warm_up = load_config(str(tmp_path / "agent_search" / "trial0" / "sft_warmup" / "config.yaml"), [])
    assert warm_up.dataset.path == str(demos_path) and "SFT custom: 1840 train /" in result.stdout
