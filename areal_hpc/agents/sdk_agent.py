"""An agent written with the OpenAI Agents SDK, trained unchanged: the SDK's ``Agent`` with function tools
runs on the episode's recording OpenAI client (``engine.openai_client()``), so every model turn, tool
calls included, is recorded token for token; the final output is scored by the run's reward.

The built-in agent answers arithmetic with a calculator tool; ``instructions`` and ``max_turns`` are
workflow arguments. Its turns send the model's reasoning back (``replay_reasoning``), so a thinking model's
tool loop stays one record. Needs the ``agents`` extra (``pip install 'areal-hpc[agents]'``).
"""

from __future__ import annotations

from areal_hpc.data.tasks import Example
from areal_hpc.extras import require

INSTRUCTIONS = "Answer with the number only. Use the calculator tool for arithmetic."


def calculate(a: float, op: str, b: float) -> str:
    """Apply op (one of + - * /) to a and b."""
    operations = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b if b else "undefined"}
    return str(operations[op]()) if op in operations else f"unknown op {op!r}; use one of + - * /"


def replay_reasoning(context) -> bool:
    """Send each turn's ``reasoning_content`` back with its message, whatever the model (the SDK's hook, from
    0.13; by default it does so for DeepSeek models only). Qwen3's template writes the reasoning of the turns
    after the user's question back where the model wrote it: without it, the request after a tool call no
    longer extends the call's turn, the conversation becomes two records, and the call's record gets none of
    the answer's reward. Templates that keep no reasoning ignore the field."""
    return True


class AgentsSDKWorkflow:
    def __init__(self, instructions: str = INSTRUCTIONS, max_turns: int = 4):
        self.sdk = require("agents")
        self.sdk.set_tracing_disabled(True)  # nothing leaves the cluster
        self.instructions, self.max_turns = instructions, max_turns
        self.tools = [self.sdk.function_tool(calculate)]

    def agent(self, client, model_name: str):
        """The calculator agent on ``client``: an episode's (``engine.openai_client()``) or any other
        ``openai.AsyncOpenAI``, e.g. one of the login-node proxy's sessions."""
        model = self.sdk.OpenAIChatCompletionsModel(
            model=model_name, openai_client=client, should_replay_reasoning_content=replay_reasoning
        )
        return self.sdk.Agent(name="calculator", instructions=self.instructions, tools=self.tools, model=model)

    async def arun_episode(self, engine, example: Example):
        client = engine.openai_client(example=example.uid)  # samples as the run does (generation.*)
        agent = self.agent(client, engine.model_name)
        try:
            result = await self.sdk.Runner.run(agent, example.chat_messages(), max_turns=self.max_turns)
            answer = str(result.final_output)
        except self.sdk.exceptions.MaxTurnsExceeded:
            answer = ""  # no answer within the turn budget: scored as such
        value = await engine.reward(example, answer)
        if client.session.turns:
            client.set_reward(value)
        return None  # the client's recorded conversations
