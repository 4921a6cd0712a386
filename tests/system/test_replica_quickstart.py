"""The quickstart (SFT warm-up, asynchronous GRPO, evaluations) runs end to end on a Llama-3-shaped and a
Gemma-3-shaped replica, each with its original's chat template: every stored trajectory's prompt is that
template's rendering of the task, and only the tokens the model produced are trained."""

import json

import pytest
from transformers import AutoTokenizer

from tests.conftest import run_cli

# What each template writes around one user turn, up to the assistant's header (models.chat_templates).
TURNS = {
    "llama3-replica": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "gemma3-replica": ("<bos><start_of_turn>user\n", "<start_of_turn>model\n"),
}


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(TURNS))
def test_the_quickstart_runs_on_a_replica_with_its_own_template(preset, tmp_path):
    out = run_cli(
        "train",
        "--config",
        "configs/quickstart.yaml",
        f"model.preset={preset}",
        f"cluster.fileroot={tmp_path}",
        "rl.sft_warmup_steps=10",
        "sft.eval_every_steps=5",
        "rl.total_train_steps=2",
        "rl.eval_every_steps=1",
        "dataset.eval_size=16",
        "saver.freq_steps=0",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "quickstart" / "trial0"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 1, 2]
    assert "held-out accuracy" in out.stdout

    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    opening, assistant = TURNS[preset]
    exported = run_cli("shards", "export", str(run / "shards"), "--output", str(tmp_path / "trajectories.jsonl"))
    assert exported.returncode == 0, exported.stderr
    trajectories = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert trajectories
    for trajectory in trajectories:
        (segment,) = trajectory["segments"]
        prompt = tokenizer.decode(segment["input_ids"])
        assert prompt.startswith(opening) and prompt.endswith(assistant), prompt
        assert len(segment["loss_mask"]) == len(segment["output_ids"]) and all(segment["loss_mask"])
        ended = segment["output_ids"][-1] == tokenizer.eos_token_id
        assert ended or len(segment["output_ids"]) == 8  # the quickstart's generation.max_new_tokens
