"""An agent program written against the OpenAI API with the OpenAI Agents SDK, knowing nothing of areal-hpc:
it reads a task as JSON on stdin, answers it with a calculator tool and prints the answer. With
`rollout.workflow=agent_program` (configs/agent_program.yaml) a run starts it once an episode, with
OPENAI_BASE_URL and OPENAI_API_KEY pointing at the run's model (OPENAI_MODEL names it); the run records
its turns and scores what it prints.

By hand, against any OpenAI-compatible server that does tool calls:
    echo '{"messages": [{"role": "user", "content": "What is 2+3?"}]}' | \\
        OPENAI_BASE_URL=... OPENAI_API_KEY=... OPENAI_MODEL=... python configs/agent_program.py
"""

import asyncio
import json
import os
import sys

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI


@function_tool
def calculate(a: float, op: str, b: float) -> str:
    """Apply op (one of + - * /) to a and b."""
    if op == "+":
        return str(a + b)
    if op == "-":
        return str(a - b)
    if op == "*":
        return str(a * b)
    if op == "/":
        return str(a / b) if b else "undefined"
    return f"unknown op {op!r}; use one of + - * /"


async def main() -> None:
    task = json.load(sys.stdin)
    agent = Agent(
        name="calculator",
        instructions="Answer with the number only. Use the calculator tool for arithmetic.",
        tools=[calculate],
        model=OpenAIChatCompletionsModel(model=os.environ["OPENAI_MODEL"], openai_client=AsyncOpenAI()),
    )
    try:
        result = await Runner.run(agent, task["messages"], max_turns=4)
        print(result.final_output)
    except MaxTurnsExceeded:
        print("")  # still calling tools after max_turns: no answer


if __name__ == "__main__":
    asyncio.run(main())
