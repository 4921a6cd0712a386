"""``areal-hpc shards export --text``: a run's records decoded by the run's own tokenizer, found from the
run folder, each context with the roles of its messages and each model turn with what of it is trained,
its policy versions and its reward; shards outside a run take ``--tokenizer``, else one line and exit 2."""

import shutil

import numpy as np
import pytest

from areal_hpc.config import load_config, save_resolved
from areal_hpc.data.shards import TrajectoryShardWriter
from areal_hpc.data.shards.report import shard_tokenizer, trajectory_text
from areal_hpc.data.trajectory import Reward, Segment, Trajectory
from areal_hpc.errors import UserError
from areal_hpc.models.chat import completion_ids, next_turn_ids, prompt_ids
from areal_hpc.models.hf import load_tokenizer
from tests.conftest import run_cli


def tool_episode(tokenizer) -> Trajectory:
    """A calculator episode as the run records it: the question, a tool call whose first two tokens a loss
    mask leaves out, the tool's reply, the answer (a weight update between the turns)."""
    prompt = prompt_ids(tokenizer, "What is 12+30?")
    call = completion_ids(tokenizer, "<calc>12+30</calc>")
    reply = next_turn_ids(tokenizer, "tool", "<result>42</result>", call)
    answer = completion_ids(tokenizer, "42")
    segments = [
        Segment(
            np.array(prompt),
            np.array(call),
            np.full(len(call), -0.5),
            np.full(len(call), 3),
            [0, 0] + [1] * (len(call) - 2),
        ),
        Segment(np.array(reply), np.array(answer), np.full(len(answer), -0.1), np.array([3] + [4] * (len(answer) - 1))),
    ]
    rewards = [Reward(0.0, step=0, source="reward_fn"), Reward(1.0, step=1, source="reward_fn")]
    return Trajectory(segments, id="t1", task="calculator", group_id="g1", rewards=rewards)


def test_a_runs_records_read_as_text_with_roles_and_loss_masks(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"cluster.fileroot={tmp_path}"])
    save_resolved(cfg)  # <run>/config.yaml, as every run writes it
    record = tool_episode(tokenizer)
    with TrajectoryShardWriter(cfg.run_dir / "shards", "w0") as writer:
        writer.append(record)

    result = run_cli("shards", "export", str(cfg.run_dir / "shards"), "--text")

    assert result.returncode == 0, result.stderr
    call, answer = (len(s.output_ids) for s in record.segments)
    head = tokenizer.decode(record.segments[0].output_ids[:2].tolist())
    assert result.stdout == (
        f"=== trajectory t1  task calculator  group g1  reward 1.0  2 turns, {record.n_tokens} tokens, "
        f"{call + answer - 2} of {call + answer} output tokens trained\n"
        f"--- context user: {len(record.segments[0].input_ids)} tokens, not trained\n"
        "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n\n"
        f"--- model turn 1: {call} tokens, {call - 2} trained, policy version 3, reward 0.0\n"
        f"[not trained: {head}]{'<calc>12+30</calc>'[len(head) :]}<|im_end|>\n"
        f"--- context tool: {len(record.segments[1].input_ids)} tokens, not trained\n"
        "\n<|im_start|>tool\n<result>42</result><|im_end|>\n<|im_start|>assistant\n\n"
        f"--- model turn 2: {answer} tokens, {answer} trained, policy version 3-4, reward 1.0\n"
        "42<|im_end|>\n"
    )


def test_shards_outside_a_run_need_a_tokenizer_named(tiny_model_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_model_dir)
    with TrajectoryShardWriter(tmp_path / "loose", "w0") as writer:
        writer.append(tool_episode(tokenizer))
    shard = next((tmp_path / "loose").glob("*.h5"))
    with pytest.raises(UserError, match="in no run folder.*give --tokenizer DIR"):
        shard_tokenizer(shard)
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").unlink()
    with pytest.raises(UserError, match="holds no tokenizer"):
        shard_tokenizer(shard, tmp_path / "model")
    named = shard_tokenizer(shard, tiny_model_dir)
    assert trajectory_text(tool_episode(tokenizer), named) == trajectory_text(tool_episode(tokenizer), tokenizer)
