"""A user's project as they would write it, outside the package: data in Parquet, a reward in a file,
an agent workflow class written against the ``openai`` client. ``write_project(folder)`` lays it out."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REWARD = '''
def reward(prompt, completion, prompt_ids, completion_ids, answer, unit, **fields):
    """1 when the reply holds the answer; the unit column comes through as a field."""
    return {"reward": float(str(answer) in completion), "reply_tokens": float(len(completion_ids)),
            "unit_is_cm": float(unit == "cm")}
'''

WORKFLOW = '''
class AskTwice:
    """An agent: asks the question, then tells the model what a (fake) tool returned and asks again."""

    def __init__(self, max_tokens=6):
        self.max_tokens = max_tokens

    async def arun_episode(self, engine, example):
        client = engine.openai_client(source="user_project")
        messages = [{"role": "user", "content": example.prompt}]
        for _ in range(2):
            reply = await client.chat.completions.create(model=engine.model_name, messages=messages,
                                                         max_tokens=self.max_tokens)
            text = reply.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": text},
                         {"role": "tool", "content": f"ruler says {example.fields['unit']}"}]
        client.set_reward(await engine.reward(example, text))
        return client.records()
'''


def write_project(folder: Path, rows: int = 48) -> dict[str, str]:
    """The project's files, and the overrides that train on them."""
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "question": [f"How long is stick {i}?" for i in range(rows)],
            "answer": [str(i % 7) for i in range(rows)],
            "unit": ["cm" if i % 2 else "mm" for i in range(rows)],
        }
    )
    pq.write_table(table, folder / "sticks.parquet")
    (folder / "my_reward.py").write_text(REWARD)
    (folder / "my_agent.py").write_text(WORKFLOW)
    return {
        "dataset.task": "custom",
        "dataset.path": str(folder / "sticks.parquet"),
        "dataset.prompt_field": "question",
        "dataset.eval_size": "4",
        "reward.fn": f"{folder / 'my_reward.py'}:reward",
        "rollout.workflow": f"{folder / 'my_agent.py'}:AskTwice",
    }
