"""An agent written with the OpenAI Agents SDK, trained unchanged: the SDK's ``Agent`` with function tools
runs on the episode's recording OpenAI client (``engine.openai_client()``), so every model turn, tool
calls included, is recorded token for token; the final output is scored by the run's reward.

The built-in agent answers arithmetic with a calculator tool; ``instructions`` and ``max_turns`` are
workflow arguments. Needs the ``agents`` extra (``pip install 'areal-hpc[agents]'``).
"""

from __future__ import annotations

from areal_hpc.data.tasks import Example
from areal_hpc.extras import require

INSTRUCTIONS = "Answer with the number only. Use the calculator tool for arithmetic."


def calculate(a: float, op: str, b: float) -> str:
    """Apply op (one of + - * /) to a and b."""
    operations = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b if b else "undefined"}
    return str(operations[op]()) if op in operations else f"unknown op {op!r}; use one of + - * /"


class AgentsSDKWorkflow:
    def __init__(self, instructions: str = INSTRUCTIONS, max_turns: int = 4):
        self.sdk = require("agents")
        self.sdk.set_tracing_disabled(True)  # nothing leaves the cluster
        self.instructions, self.max_turns = instructions, max_turns
        self.tools = [self.sdk.function_tool(calculate)]

    async def arun_episode(self, engine, example: Example):
        client = engine.openai_client(example=example.uid)  # samples as the run does (generation.*)
        agent = self.sdk.Agent(
            name="calculator",
            instructions=self.instructions,
            tools=self.tools,
            model=self.sdk.OpenAIChatCompletionsModel(model=engine.model_name, openai_client=client),
        )
        try:
            result = await self.sdk.Runner.run(agent, example.chat_messages(), max_turns=self.max_turns)
            answer = str(result.final_output)
        except self.sdk.exceptions.MaxTurnsExceeded:
            answer = ""  # no answer within the turn budget: scored as such
        value = await engine.reward(example, answer)
        if client.session.turns:
            client.set_reward(value)
        return None  # the client's recorded conversations
