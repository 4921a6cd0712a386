"""What a workflow's ``arun_episode(engine, example)`` works with: the ``EpisodeContext`` of one episode.

- ``agenerate(ids, sampling)``: one generation from the rollout servers (interruptible: a weight
  update mid-turn resumes it on the new weights, each token keeping the version that made it);
- ``episode(example)``: a token-level multi-turn record (``TokenEpisode``): the model's turns and the
  environment's tokens between them, exactly as the model saw them;
- ``openai_client()``: an ``openai.AsyncOpenAI`` bound to the rollout servers through the proxy's chat
  code, recording every turn token for token (agents written for the ``openai`` SDK or the OpenAI
  Agents SDK run unchanged), sampling as the episode does where a request does not say;
  ``openai_base_url()``: the same routes over HTTP on loopback, for an agent in a process of its own
  (with a client's ``api_key``, its requests are that client's turns);
- ``reward(example, completion, ...)``: the run's reward function, in the reward pool with its timeout;
  a failure (exception, timeout, not a number) scores 0 and is counted, never silently.

One engine serves one episode; the group runner (``agents.groups``) makes a fresh one per episode and
collects what it recorded. An engine built with a ``seed`` sends each generation a ``sampling_seed``
derived from it and the generation's number in the episode, so an episode's samples are a function of
its seed, prompt and weights (what makes synchronous runs repeat exactly).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from areal_hpc.agents.token_episode import TokenEpisode
from areal_hpc.algo.temperature import run_temperature
from areal_hpc.data.rewards import RewardOutcome, RewardPool, RewardRequest
from areal_hpc.data.tasks import Example
from areal_hpc.errors import UserError
from areal_hpc.models.chat import chat_prompt_ids, example_prompt_ids


@dataclass
class Sampling:
    """The sampling parameters of a workflow, in SGLang's names."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def from_config(cls, generation) -> Sampling:
        return cls(generation.max_new_tokens, run_temperature(generation), generation.top_p, generation.top_k)

    def params(self, stop_token_ids: list[int]) -> dict:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": stop_token_ids,
        }

    def greedy(self) -> Sampling:
        return replace(self, temperature=0.0)


class SameTickCalls:
    """Calls made in one turn of the event loop, run as one call of ``run(items) -> results`` (a result
    per item, in order, an exception among them failing its own call; an exception raised fails every
    call of the batch), or as several of at most ``max_items``. A group's episodes start together, so
    their first generations (and, answered together, their rewards) meet in one turn. A batch whose
    callers all left (cancelled) is cancelled."""

    def __init__(
        self,
        run: Callable[[list], Awaitable[list]],
        max_items: int | None = None,
        parts: Callable[[], int] | None = None,
    ):
        """``parts``: into how many calls of equal shares to split a turn's batch (e.g. one per server)."""
        self._run, self._max_items, self._parts = run, max_items, parts
        self._waiting: list[tuple[object, asyncio.Future]] = []
        self._running: set[asyncio.Task] = set()

    async def __call__(self, item):
        loop = asyncio.get_running_loop()
        if not self._waiting:
            loop.call_soon(self._flush)  # after the other callers of this turn
        future = loop.create_future()
        self._waiting.append((item, future))
        return await future

    def _flush(self) -> None:
        batch, self._waiting = [(item, f) for item, f in self._waiting if not f.done()], []
        if not batch:  # every caller left before the turn ended
            return
        size = self._max_items or len(batch)
        if self._parts is not None:
            size = min(size, -(-len(batch) // max(1, self._parts())))
        for start in range(0, len(batch), size):
            self._start(batch[start : start + size])

    def _start(self, batch: list[tuple[object, asyncio.Future]]) -> None:
        task = asyncio.ensure_future(self._run([item for item, _ in batch]))  # noqa: RUF006 - held in self._running
        self._running.add(task)
        task.add_done_callback(lambda done: self._answer(done, [f for _, f in batch]))

        waiting = [len(batch)]  # callers still waiting: when none is, the batch is not needed

        def left(_) -> None:
            waiting[0] -= 1
            if not waiting[0]:
                task.cancel()

        for _, future in batch:
            future.add_done_callback(left)

    def _answer(self, task: asyncio.Task, futures: list[asyncio.Future]) -> None:
        self._running.discard(task)
        if task.cancelled():
            results = None
        elif (error := task.exception()) is not None:
            for future in futures:
                if not future.done():
                    future.set_exception(error)
            return
        else:
            results = task.result()
        for k, future in enumerate(futures):
            if future.done():
                continue
            if results is None:
                future.cancel()
            elif isinstance(results[k], BaseException):
                future.set_exception(results[k])
            else:
                future.set_result(results[k])


class Scorer:
    """One reward pool shared by concurrent episodes, called off the event loop (the pool runs one
    call at a time); the requests of one turn of the event loop (a group's samples, answered
    together) go to the pool as one call."""

    def __init__(self, pool: RewardPool):
        self.pool = pool
        self._batch = SameTickCalls(self._score)

    async def __call__(self, requests: list[RewardRequest]) -> list[RewardOutcome]:
        return await self._batch(requests)

    async def _score(self, calls: list[list[RewardRequest]]) -> list[list[RewardOutcome]]:
        outcomes = await asyncio.to_thread(self.pool.score, [r for requests in calls for r in requests])
        ends = list(itertools.accumulate(len(requests) for requests in calls))
        return [outcomes[end - len(requests) : end] for requests, end in zip(calls, ends)]


def derive_seed(*parts) -> int:
    """A sampling seed in [0, 2**63) from any values (e.g. run seed, episode number, sample index)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


PROMPT_CACHE = 4096  # rendered prompts kept (examples in flight are far fewer)


@dataclass
class EpisodeSettings:
    """What every episode's engine shares: built once per run (or per evaluation)."""

    generate: object  # async (input_ids, sampling params) -> a Generation (RolloutClient.generate)
    tokenizer: object
    sampling: Sampling
    scorer: Scorer
    chat: object = None  # an ``agents.chat.ChatGateway`` (or ``NoChat``: why not) for workflows that chat
    discount: float = 1.0  # rollout.turn_discount
    prompts: dict = field(default_factory=dict)  # example uid -> (rendered prompt ids, their text), the latest
    # async (list of input_ids, list of sampling params) -> Generations, as one request
    # (RolloutClient.generate_batch); None: each generation is its own request
    generate_batch: object = None

    def for_group(self, max_batch: int | None = None, parts: Callable[[], int] | None = None) -> EpisodeSettings:
        """These settings for episodes that start together (groups' samples, an evaluation's examples):
        generations they ask for in the same turn of the event loop (every episode's first turn) go to the
        servers as batched /generate requests of at most ``max_batch`` (None: one request), split into
        ``parts()`` requests (e.g. one per server). A batch that fails is asked again one generation at a
        time, so only the generations that fail alone fail (one prompt over the context fails its own
        episode, not the batch's)."""
        if self.generate_batch is None:
            return self

        async def together(calls: list) -> list:
            try:
                return await self.generate_batch([ids for ids, _ in calls], [params for _, params in calls])
            except Exception:
                if len(calls) == 1:
                    raise
                return await asyncio.gather(
                    *(self.generate(ids, params) for ids, params in calls), return_exceptions=True
                )

        batch = SameTickCalls(together, max_batch, parts)
        return replace(self, generate=lambda input_ids, params: batch((input_ids, params)))

    def rendered_prompt(self, example: Example) -> tuple[list[int], str]:
        """An example's prompt ids and text, rendered once for all the episodes of its group."""
        if example.uid not in self.prompts:
            if len(self.prompts) >= PROMPT_CACHE:
                self.prompts.pop(next(iter(self.prompts)))
            ids = example_prompt_ids(self.tokenizer, example)
            self.prompts[example.uid] = ids, self.tokenizer.decode(ids, skip_special_tokens=False)
        return self.prompts[example.uid]


class EpisodeContext:
    """One episode's handle: what a workflow's ``arun_episode(engine, example)`` receives as ``engine`` (AReaL's
    parameter name): ``agenerate``, token episodes, chat clients, the reward; it records all of them."""

    def __init__(self, settings: EpisodeSettings, seed: int | None = None):
        """``seed``: this episode's sampling seed (None: the servers pick)."""
        self.settings, self.seed = settings, seed
        self.tokenizer, self.sampling = settings.tokenizer, settings.sampling
        self.stop_token_ids = [settings.tokenizer.eos_token_id]
        self.generations: list = []  # every generation of this episode (interruptions are counted from them)
        self.outcomes: list[RewardOutcome] = []  # every reward call of this episode
        self.recorders: list = []  # token episodes and chat clients handed out: their records if none returned

    @property
    def model_name(self) -> str:
        """The ``model`` chat requests name."""
        return getattr(self.settings.chat, "model_name", "")

    async def agenerate(
        self, input_ids: list[int], sampling: Sampling | None = None, stop_token_ids: list[int] | None = None
    ):
        """Generate after ``input_ids`` (a ``rollout.client.Generation``: output ids, logprobs, versions)."""
        params = (sampling or self.sampling).params(stop_token_ids or self.stop_token_ids)
        if self.seed is not None:
            params["sampling_seed"] = derive_seed(self.seed, len(self.generations))
        generation = await self.settings.generate(list(input_ids), params)
        self.generations.append(generation)
        return generation

    def prompt_ids(self, example: Example) -> list[int]:
        return list(self.settings.rendered_prompt(example)[0])

    def opening_ids(self, example: Example) -> list[int]:
        """The rendered start of a tool agent's episode (``Example.opening_messages``): the question, never a
        demonstration's later turns."""
        return chat_prompt_ids(self.tokenizer, example.opening_messages())

    def episode(self, example: Example | None = None, prompt_ids: list[int] | None = None) -> TokenEpisode:
        """A token-level record starting from the example's rendered prompt (or ``prompt_ids``)."""
        recorder = TokenEpisode(
            self, self.prompt_ids(example) if prompt_ids is None else prompt_ids, self.settings.discount
        )
        self.recorders.append(recorder)
        return recorder

    def openai_client(self, **metadata):
        """An ``openai.AsyncOpenAI`` whose every turn is recorded (one session: its conversations become
        records when the episode ends); ``metadata`` is stored with them. A request that gives no
        ``max_tokens``, ``temperature`` or ``top_p`` samples as the episode does (``sampling``), and an
        episode that decodes greedily (an evaluation) decodes every turn greedily."""
        if self.settings.chat is None:
            raise UserError("this engine serves no OpenAI client: build its settings with an agents.chat.ChatGateway")
        client = self.settings.chat.client(metadata, self.sampling)
        self.recorders.append(client)
        return client

    async def openai_base_url(self) -> str:
        """Where an agent program in another process (on this node) sends its OpenAI API requests:
        ``http://127.0.0.1:PORT/v1``; with the ``api_key`` of a client from ``openai_client()`` they are that
        client's turns, recorded and sampled as its own."""
        if self.settings.chat is None:
            raise UserError("this engine serves no OpenAI API: build its settings with an agents.chat.ChatGateway")
        return await self.settings.chat.base_url()

    async def reward(
        self,
        example: Example,
        completion: str,
        completion_ids: list[int] = (),
        prompt_ids: list[int] | None = None,
        prompt: str | None = None,
    ) -> float:
        """The run's reward of ``completion`` (0 when it failed; the failure is counted)."""
        if prompt_ids is None:
            prompt_ids, text = self.settings.rendered_prompt(example)
        else:
            text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        text = text if prompt is None else prompt
        [outcome] = await self.settings.scorer(
            [RewardRequest(text, completion, list(prompt_ids), list(completion_ids), example.reward_fields())]
        )
        self.outcomes.append(outcome)
        return outcome.value

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
