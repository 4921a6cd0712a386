"""Your data, read offline in every form ``dataset.path`` takes (JSONL, Parquet, Arrow, a folder, a glob,
``save_to_disk`` folders), mapped to examples the same way whatever the form; chat prompts rendered by
the model's template; OpenAI messages with tool calls and a ``tools`` column read alike from JSONL and Parquet;
bad paths, missing columns, tools and messages are one line naming what there is."""

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_hpc.config import DatasetConfig, RewardConfig
from areal_hpc.data.registry import build_task
from areal_hpc.errors import UserError
from areal_hpc.models.chat import example_prompt_ids
from areal_hpc.models.hf import load_tokenizer
from tests.conftest import REPO

ROWS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3} for i in range(30)]
REWARD = RewardConfig(fn="tests.rewards_for_tests:exact_answer")


def custom(path, **kw) -> DatasetConfig:
    return DatasetConfig(task="custom", path=str(path), prompt_field="question", eval_size=6, **kw)


def write_forms(folder) -> dict[str, str]:
    """The same rows in every form; form -> the path to give."""
    table = pa.Table.from_pylist(ROWS)
    (folder / "shards").mkdir(parents=True)
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pq.write_table(table, folder / "rows.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder / "saved"))
    arrow = next((folder / "saved").glob("*.arrow"))
    for k in range(3):
        (folder / "shards" / f"part-{k}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in ROWS[k * 10 : (k + 1) * 10])
        )
    return {
        "jsonl": str(folder / "rows.jsonl"),
        "parquet": str(folder / "rows.parquet"),
        "arrow": str(arrow),
        "saved": str(folder / "saved"),
        "folder": str(folder / "shards"),
        "glob": str(folder / "shards" / "part-*.jsonl"),
    }


def test_every_form_gives_the_same_examples_with_the_other_columns_passed_through(tmp_path):
    tasks = {form: build_task(custom(path), REWARD) for form, path in write_forms(tmp_path).items()}
    reference = tasks["jsonl"]
    assert len(reference.train) == 24 and len(reference.eval) == 6
    for form, task in tasks.items():
        assert [(e.prompt, e.answer, e.fields) for e in task.train] == [
            (e.prompt, e.answer, e.fields) for e in reference.train
        ], form
    assert {e.fields["level"] for e in reference.train} == {0, 1, 2} and not reference.train[0].messages
    held_out = {e.prompt for e in reference.eval}
    assert not held_out & {e.prompt for e in reference.train}
    assert build_task(custom(write_forms(tmp_path / "again")["jsonl"], seed=1), REWARD).eval != reference.eval


def test_a_saved_dataset_dict_gives_its_test_split_for_evaluation_and_eval_path_wins(tmp_path):
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:20]), "test": datasets.Dataset.from_list(ROWS[20:])}
    ).save_to_disk(str(tmp_path / "dd"))
    task = build_task(custom(tmp_path / "dd"), REWARD)
    assert [e.answer for e in task.eval] == [r["answer"] for r in ROWS[20:26]] and len(task.train) == 20
    (tmp_path / "eval.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    assert [
        e.prompt for e in build_task(custom(tmp_path / "dd", eval_path=str(tmp_path / "eval.jsonl")), REWARD).eval
    ] == [ROWS[0]["question"]]
    with pytest.raises(UserError, match="has splits train, test, not 'validation'"):
        build_task(custom(tmp_path / "dd", eval_split="validation"), REWARD)


def test_chat_prompts_are_rendered_by_the_models_template(tmp_path, tiny_model_dir):
    rows = [
        {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}+1?"}],
            "answer": str(i + 1),
        }
        for i in range(10)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = build_task(DatasetConfig(task="custom", path=str(tmp_path / "chat.jsonl"), eval_size=2), REWARD)
    example = task.train[0]
    tokenizer = load_tokenizer(tiny_model_dir)
    expected = tokenizer.apply_chat_template(list(example.messages), tokenize=False, add_generation_prompt=True)
    assert example.prompt == "" and example.messages[0]["role"] == "system"
    assert tokenizer.decode(example_prompt_ids(tokenizer, example), skip_special_tokens=False) == expected


@pytest.mark.parametrize(
    "config, words",
    [
        (dict(prompt_field="title"), ["'dataset.prompt_field'", "no column 'title'", "question, answer, level"]),
        (dict(answer_field="solution"), ["'dataset.answer_field'", "no column 'solution'"]),
        (dict(target_field="worked"), ["'dataset.target_field'", "no column 'worked'"]),
    ],
)
def test_a_missing_column_is_one_line_listing_the_columns(tmp_path, config, words):
    path = write_forms(tmp_path)["parquet"]
    with pytest.raises(UserError) as err:
        build_task(DatasetConfig(task="custom", path=path, **{"prompt_field": "question", **config}), REWARD)
    assert all(w in str(err.value) for w in words), err.value


def test_bad_paths_and_mixed_folders_are_one_line(tmp_path):
    forms = write_forms(tmp_path)
    (tmp_path / "shards" / "notes.parquet").write_bytes(b"")
    cases = [
        (custom(tmp_path / "nowhere.jsonl"), "does not exist"),
        (custom(tmp_path / "shards"), "files of one format"),
        (custom(str(tmp_path / "none-*.jsonl")), "holds no data files"),
        (DatasetConfig(task="custom", path=forms["jsonl"]), "reward.fn"),
        (DatasetConfig(task="arithmetic", path=forms["jsonl"]), "generates its problems"),
    ]
    for cfg, words in cases:
        with pytest.raises(UserError, match=words):
            build_task(cfg, None if "reward" in words else REWARD)


@given(rewards=st.dictionaries(st.integers(0, 5), st.floats(-2, 2), max_size=6), discount=st.floats(0, 1))
def test_an_episodes_reward_is_its_first_turns_discounted_return(rewards, discount):
    """What is trained equals the proxy's own return of the first turn, and the float64 sum."""
    from areal_hpc.data.trajectory import Reward, Segment, Trajectory
    from areal_hpc.proxy.sessions import discounted_returns

    turns = 6
    record = Trajectory(
        [Segment([1], [2], [0.0], [0]) for _ in range(turns)],
        metadata={"discount": discount},
        rewards=[Reward(v, step=s) for s, v in rewards.items()],
    )
    expected = sum(v * discount**s for s, v in rewards.items()) if rewards else None
    assert record.reward == (None if expected is None else pytest.approx(expected, abs=1e-12))
    if rewards:
        assert record.reward == pytest.approx(discounted_returns(rewards, turns, discount)[0], abs=1e-12)


@pytest.mark.parametrize("config", sorted(str(p) for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_builds_its_workflow_and_task(config, tmp_path):
    """What `areal-hpc train --config` checks before anything starts: data, reward and workflow load."""
    from areal_hpc.agents.search import dataset
    from areal_hpc.config import load_config
    from areal_hpc.train.task_setup import check_task

    overrides = []
    if "agent_search" in config:  # its data is written by a command first (the config's header says so)
        overrides = [
            f"dataset.path={tmp_path / 'search' / 'train.jsonl'}",
            f"dataset.eval_path={tmp_path / 'search' / 'test.jsonl'}",
            f"rl.sft_warmup_path={tmp_path / 'search' / 'demos.jsonl'}",
        ]
        assert dataset.main(["--config", config, *overrides]) == 0
    check_task(load_config(config, ["dataset.train_size=50", *overrides]))


ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}},
}
TIMES = {"type": "function", "function": {"name": "times", "description": "a*b", "parameters": {"type": "object"}}}
CALLED = [
    {"role": "user", "content": "2+3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}],
    },
    {"role": "tool", "tool_call_id": "c", "content": "5"},
    {"role": "assistant", "content": "5", "reasoning_content": "Read it.", "weight": 0},
]


def test_tool_demonstrations_read_alike_from_jsonl_parquet_and_json_text(tmp_path):
    """OpenAI messages and tools, their keys differing between rows: Parquet fills each row's objects with the
    other rows' keys as nulls, which are dropped; tools given as JSON text are read as written."""
    rows = [
        {"messages": CALLED, "tools": [ADD], "answer": "5"},
        {"messages": CALLED[:1], "tools": [TIMES, ADD], "answer": "6"},
        {"messages": [{"role": "user", "content": "Hi"}], "tools": None, "answer": "7"},
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    pq.write_table(
        pa.Table.from_pylist([{**r, "tools": json.dumps(r["tools"]) if r["tools"] else ""} for r in rows]),
        tmp_path / "text.parquet",
    )
    expected = [
        ([{**CALLED[0]}, {**CALLED[1], "content": ""}, CALLED[2], CALLED[3]], [ADD]),
        ([CALLED[0]], [TIMES, ADD]),
        ([{"role": "user", "content": "Hi"}], []),
    ]
    for name in ("rows.jsonl", "rows.parquet", "text.parquet"):
        cfg = DatasetConfig(task="custom", path=str(tmp_path / name), eval_path=str(tmp_path / name))
        task = build_task(cfg, REWARD)
        assert [(list(e.messages), list(e.tools)) for e in task.eval] == expected, name
        assert all("tools" not in e.fields for e in task.eval)


@pytest.mark.parametrize(
    "row, words",
    [
        ({"tools": {"type": "function"}}, "column 'tools' is dict .*; give a list of OpenAI function tools"),
        ({"tools": "[{"}, "column 'tools' is not JSON .*; give a list of OpenAI function tools"),
        ({"tools": [ADD, "add"]}, "column 'tools' is list .*; give a list of OpenAI function tools"),
        ({"messages": [{"content": "2+3?"}]}, "column 'messages': message 0 is .*; give a list of {'role', 'content'}"),
        (
            {"messages": [CALLED[0], {"role": "assistant", "tool_calls": [{"name": "add"}]}]},
            "message 1's tool_calls = .*; an assistant message's tool calls are ",
        ),
        ({"messages": [{**CALLED[0], "weight": 0}]}, r"message 0 \(user\) has weight 0; an assistant message may"),
        ({"messages": [CALLED[0], {"role": "assistant", "content": "5", "weight": 0.5}]}, "has weight 0.5; an assist"),
    ],
    ids=[
        "tools-object",
        "tools-bad-json",
        "tools-not-objects",
        "no-role",
        "bad-tool-calls",
        "user-weight",
        "weight-half",
    ],
)
def test_bad_tools_and_messages_are_one_line_naming_the_row(tmp_path, row, words):
    row = {"messages": CALLED[:1], "answer": "5", **row}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    cfg = DatasetConfig(task="custom", path=str(tmp_path / "rows.jsonl"), eval_path=str(tmp_path / "rows.jsonl"))
    with pytest.raises(UserError, match=f"^rows.jsonl/0: .*{words}") as error:
        build_task(cfg, REWARD)
    assert "\n" not in str(error.value)
