"""TRL's side of bench/peer_trl.py: Hugging Face TRL's ``GRPOTrainer`` as its users run it, in a process
that imports torch, transformers, datasets and trl and nothing of this project.

    python bench/peer_trl_child.py SPEC.json     # what bench/peer_trl.py starts, once per TRL run
    python bench/peer_trl_child.py --imports     # the imports alone; prints the areal_hpc modules loaded (none)

SPEC.json, written by the parent before this process starts, holds everything it needs: the start model's
folder (a Hugging Face folder, loaded with ``AutoModelForCausalLM``/``AutoTokenizer``), the prompts in the
order TRL trains on them (chat messages; TRL renders them with the tokenizer's chat template) with each one's
answer, and ``GRPOConfig``'s arguments (the parent maps the project's config onto them: learning rate,
schedule, warm-up, weight decay, Adam's betas and eps, clipping, sampling, checkpoint steps). The reward is
``answer_reward`` below, a plain re-implementation of the arithmetic task's reward (the last number of the
completion equals the answer); the parent checks that it agrees with the project's reward on every episode
it evaluates and on the training completions this process samples into ``rewards``.

No evaluation runs here: the Trainer saves checkpoints (model, tokenizer, optimizer, scheduler and RNG state,
its default) every ``save_steps`` and at the end, as ours does, and the parent evaluates those it needs (the
last few, or all) afterwards with ``areal-hpc eval``. torch keeps its own thread count (nothing here sets it).

Besides training it writes, for the parent: ``metrics`` (one JSON line per step: its end time, seconds since
the previous step's end, the mean reward of the last generation), ``prompt_ids`` (the token ids of every
prompt row ``generate()`` received, left padding stripped: the parent checks them against the project's
rendering), ``rewards`` (the first group of every generation: completion, answer, reward) and ``report``
(the areal_hpc modules loaded at the end, which must be none, torch's thread count and the versions).
"""

from __future__ import annotations

import json
import re
import sys
import time
from fractions import Fraction
from pathlib import Path

# The arithmetic task's decision, re-implemented: the last number written in (the last 4,096 characters of)
# the completion, commas dropped, equals the answer as a number.
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
SCORED_CHARS = 4096


def as_number(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(",", "").strip())
    except (ValueError, ZeroDivisionError):
        return None


def answer_reward(completion: str, answer: str) -> float:
    """1.0 when the last number in ``completion`` equals ``answer``, else 0.0."""
    found = NUMBER.findall(completion[-SCORED_CHARS:])
    got = as_number(found[-1]) if found else None
    return 1.0 if got is not None and got == as_number(answer) else 0.0


def completion_text(completion) -> str:
    """TRL hands a conversational completion as ``[{"role": "assistant", "content": text}]``, else the text."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def project_modules() -> list[str]:
    return sorted(name for name in sys.modules if name == "areal_hpc" or name.startswith("areal_hpc."))


def load_libraries():
    import datasets
    import torch
    import transformers
    import trl

    return torch, transformers, datasets, trl


def checkpointing_field(config_class) -> str:
    """GRPOConfig checkpoints activations unless told not to; transformers 5.24+ names that field
    ``activation_checkpointing``, earlier ``gradient_checkpointing``."""
    fields = config_class.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


class PromptRecorder:
    """Wraps ``model.generate`` to write the prompt ids of every row it receives (one JSON line per call)."""

    def __init__(self, model, out: Path):
        self.generate, self.out = model.generate, out.open("w")
        model.generate = self

    def __call__(self, input_ids, attention_mask, **kwargs):
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        self.out.write(json.dumps(rows) + "\n")
        self.out.flush()
        return self.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def train(spec: dict) -> None:
    torch, transformers, datasets, trl = load_libraries()
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"], local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"],
        dtype=getattr(torch, spec["dtype"]),
        attn_implementation=spec["attn_implementation"],
        local_files_only=True,
    )
    dataset = datasets.Dataset.from_list(spec["prompts"])  # columns "prompt" (chat messages) and "answer"
    group = spec["grpo_config"]["num_generations"]
    metrics, samples = Path(spec["metrics"]).open("w"), Path(spec["rewards"]).open("w")  # noqa: SIM115 - written through the training run, closed at its end
    last: list[float] = []

    def reward(prompts, completions, answer, **_) -> list[float]:
        texts = [completion_text(c) for c in completions]
        last[:] = [answer_reward(text, want) for text, want in zip(texts, answer)]
        samples.write(
            json.dumps({"completions": texts[:group], "answers": list(answer[:group]), "rewards": last[:group]}) + "\n"
        )
        return list(last)

    class StepClock(TrainerCallback):
        """Each step's end time, its seconds since the previous step's end and the last generation's mean reward."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            metrics.write(
                json.dumps(
                    {
                        "step": state.global_step,
                        "time": time.time(),
                        "time/step": now - self.mark,
                        "rollout/reward": sum(last) / len(last),
                    }
                )
                + "\n"
            )
            metrics.flush()
            self.mark = now

    PromptRecorder(model, Path(spec["prompt_ids"]))
    config = GRPOConfig(**spec["grpo_config"], **{checkpointing_field(GRPOConfig): False})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.train()
    metrics.close()
    samples.close()
    Path(spec["report"]).write_text(
        json.dumps(
            {
                "areal_hpc_modules": project_modules(),
                "torch_threads": torch.get_num_threads(),
                "versions": {
                    name: module.__version__
                    for name, module in (
                        ("torch", torch),
                        ("transformers", transformers),
                        ("datasets", datasets),
                        ("trl", trl),
                    )
                },
            }
        )
    )
    assert not project_modules(), f"the TRL process imported {project_modules()}"


def main(argv: list[str]) -> None:
    here = Path(__file__).resolve().parent  # run as a script, bench/ heads sys.path: nothing of it is imported
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    if argv == ["--imports"]:
        load_libraries()
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401  (what ``train`` imports)

        print(json.dumps({"areal_hpc_modules": project_modules()}))
        return
    if len(argv) != 1:
        sys.exit("usage: python bench/peer_trl_child.py SPEC.json | --imports")
    train(json.loads(Path(argv[0]).read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
