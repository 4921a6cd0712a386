"""The embedded rollout engine: continuous batching on CPU (or one GPU) behind SGLang's contract.

One thread owns the model. Between decode steps it runs queued commands (pause, weight updates),
admits waiting requests into free KV rows (one batched prefill) and retires finished ones, so
requests join and leave the running batch at every step. Waiting requests are admitted from their
sources (a /generate call's prompts share one) in turn, and no source holds every row: a call of
3,000 prompts leaves rows to a request that arrives after it, which starts at the next step. Every
output token is tagged with the weight version that produced it; a pause in abort mode returns
in-flight requests at once with what they have.

Gathering returning turns (``gather_s`` > 0, ``rollout.gather_ms``; off by default: on the tiny model it
saved a few forward passes a round, within the machine's noise): an agent sends its next turn as soon as it
gets an answer, so the episodes of a batch that finished together come back staggered (their client handles
one reply at a time), and admitted as they arrive they would join in several prefills, the late ones
decoding in short batches after the rest are done. So once requests finish, admission waits while fewer
requests wait than have just finished (and rows are free), as long as they keep arriving within ``gather_s``
of each other (and at most ``MAX_GATHERS`` windows in all): the next turns join in one prefill. Requests
arriving at an engine that finished nothing in the last window are admitted as before.

Prefix cache (``prefix_cache.PrefixTree``, as SGLang's radix cache): the keys and values of every request
that leaves its row without an error (finished, or aborted with its partial output) are kept, up to
``prefix_cache_mb``; a request is admitted with the longest cached prefix of its prompt copied into its row
(all but the prompt's last token at most: its logits are needed) and prefills only the rest, and reports
how many tokens it took from the cache (``Result.cached_tokens``). The prefixes of running requests are
pinned (never evicted); every weight update clears the cache, and a request that was running across one
adds nothing to it (its keys mix two versions).

Logprobs: each output token's logprob is ``log_softmax(logits / T)`` at the request's temperature T,
of the whole tempered distribution, before top-p/top-k truncation (which only restricts what is drawn):
the behaviour policy decoupled PPO needs, which the trainer recomputes at the same T. At T = 1 they
equal a teacher-forced pass. Temperature 0 is greedy (argmax; top-p/top-k change nothing) and its
logprobs are those of T = 1, as SGLang reports them. Temperatures in (0, 1e-6) are refused: logits / T
overflows float32 as T nears 0 (1e-40 gives NaN probabilities), and SGLang would serve them greedily
with T = 1 logprobs, which the trainer could not reproduce.

Sampling parameters beyond what the sampler's tensors hold (a temperature above float32's largest
number, a top_k beyond int64) and stop tokens outside the vocabulary are refused before queueing.
Failures stay with their request: a row whose logits are not finite fails alone, a forward pass that
raises (a prefill includes setting its rows' sampling parameters) is rerun one row at a time and only
the rows that fail alone are failed. Weight updates are all or nothing: tensors are checked against
the live model (names, shapes, floating dtypes; a disk checkpoint must hold every tensor) before any
is copied in, so a refused update changes neither the weights nor the version. Another floating
dtype is cast to the live one, as SGLang's loader does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import logging
import math
import reprlib
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from areal_hpc.algo.logprobs import token_logprobs
from areal_hpc.algo.temperature import MIN_TEMPERATURE, is_servable
from areal_hpc.models.hf import CheckpointError, read_checkpoint
from areal_hpc.rollout.decoder import SlotDecoder
from areal_hpc.rollout.prefix_cache import Node, PrefixTree
from areal_hpc.rollout.sampling import MAX_SEED, MAX_TEMPERATURE, MAX_TOP_K, SlotSampler
from areal_hpc.rollout.weights import weight_mismatches

# The model's fault (temperatures are >= 1e-6, so finite logits stay finite once divided): /health says so.
NOT_FINITE = "the model's logits are not finite (NaN or inf)"
log = logging.getLogger(__name__)
MAX_GATHERS = 10  # admission waits for returning turns at most this many gather windows past the first departure


class RequestError(ValueError):
    """A request the engine cannot serve as asked (the server answers 400 with this message)."""


class GenerationFailure(RuntimeError):
    """The generator could not finish a request (the server answers 500 with this message)."""


def _finite(value) -> float | None:
    """A JSON number as a finite float; None for anything else (bools, NaN, inf, ints beyond float)."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


SAMPLING_CHECKS = [  # field, what is valid, test; in order (a later test may assume an earlier one passed)
    ("max_new_tokens", "an integer >= 0", lambda v: type(v) is int and v >= 0),  # vs context: EmbeddedGenerator.check
    (
        "temperature",
        f"0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}",
        lambda v: (t := _finite(v)) is not None and is_servable(t),
    ),
    ("temperature", f"at most {MAX_TEMPERATURE!r} (float32's largest number)", lambda v: v <= MAX_TEMPERATURE),
    ("top_p", "a number in (0, 1]", lambda v: (p := _finite(v)) is not None and 0 < p <= 1),
    ("top_k", f"-1 or an integer in [1, {MAX_TOP_K}]", lambda v: type(v) is int and (v == -1 or 1 <= v <= MAX_TOP_K)),
    ("stop_token_ids", "a list of integers", lambda v: type(v) is list and all(type(t) is int for t in v)),
    ("ignore_eos", "true or false", lambda v: type(v) is bool),
    (
        "sampling_seed",
        f"null or an integer in [0, {MAX_SEED}]",
        lambda v: v is None or (type(v) is int and 0 <= v <= MAX_SEED),
    ),
]


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None  # the same seed, prompt and weights give the same tokens (None: the engine's)

    @classmethod
    def from_json(cls, obj) -> SamplingParams:
        """Check field names, types and ranges; the message names the field and what is valid."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise RequestError(f"sampling_params must be an object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(cls.__dataclass_fields__))
        if unknown:
            raise RequestError(f"unknown sampling_params {unknown}; valid: {sorted(cls.__dataclass_fields__)}")
        params = cls(**obj)
        for name, valid, ok in SAMPLING_CHECKS:
            if not ok(getattr(params, name)):
                raise RequestError(
                    f"sampling_params.{name} = {reprlib.repr(getattr(params, name))}; it must be {valid}"
                )
        params.temperature, params.top_p = float(params.temperature), float(params.top_p)
        return params


@dataclass
class Result:
    rid: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # weight version of every output token
    finish_reason: str  # "stop", "length" or "abort"
    matched_stop: int | None
    prompt_tokens: int
    weight_version: int
    error: str | None = None  # the engine failed this request (the server answers 500 with it)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not prefilled)


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_done: Callable[[Result], None]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    error: str | None = None  # set when the engine fails this request
    source: str = ""  # requests from one source (a /generate call's prompts) share rows fairly; "": the rid
    cached: int = 0  # prompt tokens found in the prefix cache at admission
    prefix: Node | None = None  # where they end in the cache (pinned while the request runs)
    epoch: int = 0  # the cache's epoch then: a later one (weights changed) takes nothing from this request

    def __post_init__(self) -> None:
        self.source = self.source or self.rid


class EmbeddedGenerator:
    """Serve generation requests from one model with continuous batching; thread-safe entry points."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        slots: int = 32,
        context_length: int | None = None,
        seed: int = 0,
        eos_token_ids: list[int] | None = None,
        min_prefill_batch: int | None = None,
        prefix_cache_mb: float = 0.0,
        gather_s: float = 0.0,
    ):
        """``min_prefill_batch``: while sequences are decoding, admit waiting ones only once this many
        rows are free (default slots // 8), since on CPU a prefill costs as much as a decode step. One
        source holds at most ``slots - min_prefill_batch`` rows (all of them with one slot): the rest wait
        for requests from other sources. ``prefix_cache_mb``: memory of the prefix cache (0: none; a server takes
        ``rollout.prefix_cache_mb``). ``gather_s``: the longest gap between arrivals while admission waits
        for the turns of requests that just finished (module docstring; 0: never waits)."""
        self.model = model.eval()
        self.context_length = context_length or model.config.max_position_embeddings
        self.decoder = SlotDecoder(model, slots, self.context_length)
        eos = eos_token_ids if eos_token_ids is not None else model.config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.min_prefill_batch = min_prefill_batch or max(1, slots // 8)
        self.rows_per_source = max(1, slots - self.min_prefill_batch)
        self.forward_passes = 0  # prefills and decode steps run (a request's latency in passes, for tests)
        self.prompt_tokens = {"prefilled": 0, "cached": 0}  # of admitted requests, since the start
        budget = int(prefix_cache_mb * 2**20) // self.decoder.bytes_per_token
        self.prefix_cache = PrefixTree(budget, _split_block) if budget > 0 else None
        self.version = 0
        self.paused = False
        self.failing: str | None = None  # the model's or engine's last fault, until a token is generated (/health)
        self.sampler = SlotSampler(slots, self.decoder.device, seed)
        self._waiting: dict[str, deque[Request]] = {}  # by source, in turn order (next to admit first)
        self._running: list[Request] = []  # row i of the KV cache holds self._running[i]
        self._commands: deque[tuple[Callable, concurrent.futures.Future]] = deque()
        self._wake = threading.Condition()
        self.gather_s = gather_s
        self._returning = 0  # requests finished in the open gather window, less those admitted since
        self._gather_end = 0.0  # when the window closes (time.monotonic): gather_s past the last departure or arrival
        self._gather_limit = 0.0  # ... at the latest (MAX_GATHERS windows past its opening)
        self._stopped = False
        _release_openmp_threads()
        self._thread = threading.Thread(target=self._loop, name="embedded-engine", daemon=True)
        self._thread.start()

    # -- entry points (any thread) -------------------------------------------------------------
    def check(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a prompt this engine cannot serve (before anything is queued)."""
        vocab = self.model.config.vocab_size
        if not input_ids:
            raise RequestError("input_ids is empty")
        if max(input_ids) >= vocab:
            raise RequestError(
                f"input_ids hold token {reprlib.repr(max(input_ids))}; the vocabulary has {vocab} tokens"
            )
        if not all(0 <= t < vocab for t in params.stop_token_ids):
            raise RequestError(
                f"sampling_params.stop_token_ids = {reprlib.repr(params.stop_token_ids)}; "
                f"they must be token ids in [0, {vocab})"
            )
        if len(input_ids) + params.max_new_tokens > self.context_length:
            raise RequestError(
                f"too many tokens: {len(input_ids)} prompt + {reprlib.repr(params.max_new_tokens)} "
                f"max_new_tokens > context length {self.context_length}"
            )

    def submit(self, request: Request) -> None:
        self.check(request.input_ids, request.params)
        with self._wake:
            self._waiting.setdefault(request.source, deque()).append(request)
            now = time.monotonic()
            if self._returning and now < self._gather_end:  # an arrival keeps the window open
                self._gather_end = min(now + self.gather_s, self._gather_limit)
            self._wake.notify()

    async def generate(self, rid: str, input_ids: list[int], params: SamplingParams, source: str = "") -> Result:
        """Submit one request and await its result from an event loop; a cancelled caller aborts it
        (no decode steps spent on an answer nobody reads), a request the engine fails raises.
        ``source``: the requests of one caller's batch share it (see ``_admissible``)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def resolve(result: Result) -> None:
            if not done.done():
                done.set_result(result)

        self.submit(
            Request(rid, input_ids, params, lambda result: loop.call_soon_threadsafe(resolve, result), source=source)
        )
        try:
            result = await done
        except asyncio.CancelledError:
            self.abort(rid)
            raise
        if result.error is not None:
            raise GenerationFailure(f"request {rid} failed in the engine: {result.error}")
        return result

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between two decode steps (weights change only there)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            self._commands.append((fn, future))
            self._wake.notify()
        return future

    def score(self, input_ids: list[int], start: int) -> concurrent.futures.Future:
        """SGLang's input logprobs of ``input_ids`` from position ``start``: one entry per position
        start..n-1, the first None (SGLang's convention), entry j log p(token start+j | the tokens
        before it) under ``log_softmax(logits)`` (temperature 1): one teacher-forced pass on the engine
        thread, between two decode steps, with the weights of the moment."""
        return self.call(lambda: self._score(input_ids, start))

    def pause(self) -> concurrent.futures.Future:
        """Abort mode: in-flight and queued requests return now with their partial output."""

        def pause():
            self.paused = True
            self._abort(lambda r: True)

        return self.call(pause)

    def resume(self) -> concurrent.futures.Future:
        def resume():
            self.paused = False

        return self.call(resume)

    def abort(self, rid: str | None) -> concurrent.futures.Future:
        """Abort one request (or all when ``rid`` is None); it returns with finish reason ``abort``."""
        return self.call(lambda: self._abort(lambda r: rid is None or r.rid == rid))

    def flush_cache(self) -> concurrent.futures.Future:
        """Empty the prefix cache (SGLang's /flush_cache)."""
        return self.call(self._flush)

    def update_weights(
        self, state: dict[str, torch.Tensor], version: int | None, *, complete: bool
    ) -> concurrent.futures.Future:
        """Check ``state`` against the live model and copy it in, all or nothing, between two steps;
        ``complete``: it must hold every tensor (a checkpoint), not one bucket of them. The future
        raises RequestError, weights and version unchanged, on the first mismatch."""
        return self.call(lambda: self._load_weights(state, version, complete))

    def update_weights_from_disk(self, path: str | Path, version: int | None = None) -> concurrent.futures.Future:
        """Read the checkpoint here (the caller's thread), load it on the engine thread."""
        try:
            state = read_checkpoint(path)
        except CheckpointError as exc:
            raise RequestError(str(exc)) from exc
        return self.update_weights(state, version, complete=True)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        with self._wake:  # the engine thread changes the queues' dict
            return sum(len(queue) for queue in self._waiting.values())

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # -- engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while (sleep := self._idle()) != 0:
                    self._wake.wait(sleep)
                if self._stopped:
                    return
                commands, self._commands = list(self._commands), deque()
            for fn, future in commands:
                try:
                    future.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - reported to the caller (the HTTP handler), engine carries on
                    future.set_exception(exc)
            try:
                self._admit()
                if self._running:
                    self._step()
            except Exception as exc:
                log.exception("engine step failed")
                self.failing = f"{type(exc).__name__}: {exc}"
                for request in self._running:
                    request.error = self.failing
                self._retire([(r, "abort", None) for r in self._running])

    def _load_weights(self, state: dict[str, torch.Tensor], version: int | None, complete: bool) -> None:
        live = self.model.state_dict()
        problems = weight_mismatches(live, state, complete)
        if problems:
            more = f" (and {len(problems) - 1} more mismatches)" if len(problems) > 1 else ""
            raise RequestError(f"weights not loaded (version {self.version} kept): {problems[0]}{more}")
        with torch.no_grad():
            for name, tensor in state.items():
                live[name].copy_(tensor)  # casts to the live dtype and device
        self.decoder.refresh_weights()
        self.version = self.version + 1 if version is None else version
        self._flush()

    def _flush(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            for request in self._running:  # prefilled already: their prefixes' memory can go
                request.prefix = None

    @torch.no_grad()
    def _score(self, input_ids: list[int], start: int) -> list[float | None]:
        """The LM head only at the scored positions, its log-softmax a chunk of them at a time
        (``algo.logprobs``): a long prompt's [tokens x vocabulary] logits never exist at once."""
        ids = torch.tensor([input_ids], device=self.decoder.device)
        hidden = self.model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0, start:-1]
        head, softcap = self.model.get_output_embeddings(), getattr(self.model.config, "final_logit_softcapping", None)
        picked, _ = token_logprobs(
            hidden, ids[0, start + 1 :], weight=head.weight, bias=head.bias, softcap=softcap, entropy=False
        )
        return [None, *picked.tolist()]

    def _idle(self) -> float | None:
        """How long the engine thread may sleep now (under ``_wake``): 0 not at all, None until woken."""
        if self._stopped or self._commands or self._running:
            return 0
        if not self._waiting or self.paused:
            return None
        return self._gathering()

    def _gathering(self) -> float:
        """Seconds admission still waits for the turns of requests that just finished (under ``_wake``):
        0 once as many wait as finished (or as rows are free), or the window has closed."""
        if not self._returning:
            return 0
        left = self._gather_end - time.monotonic()
        if left <= 0:
            self._returning = 0
            return 0
        free = self.decoder.slots - len(self._running)
        return 0 if self._admissible(free)[1] >= min(self._returning, free) else left

    def _admit(self) -> None:
        """Move waiting requests into free rows, prefilled together in one forward pass."""
        if self.paused or not self._waiting:
            return
        with self._wake:
            if self._gathering():
                return  # the turns of requests that just finished are still arriving: one prefill for them all
            sources, could_start = self._admissible(self.decoder.slots - len(self._running))
            if len(sources) < min(self.min_prefill_batch, could_start) and self._running:
                return  # a prefill costs a decode step: wait until it can serve several requests
            batch = [self._take(source) for source in sources]
            self._returning = max(0, self._returning - len(batch))
        for request in [r for r in batch if r.params.max_new_tokens == 0]:
            self._reply(request, "length")
        batch = [r for r in batch if r.params.max_new_tokens > 0]
        for request in batch:
            self._match_prefix(request)
        if batch:
            first = len(self._running)
            self._running += batch
            self._advance(first, batch, self._prefill)

    def _admissible(self, free: int) -> tuple[list[str], int]:
        """The sources of the next requests to admit into ``free`` rows (``admission_order``), none beyond
        ``rows_per_source`` rows; and how many waiting requests could start given rows enough (so a lone
        request from a new source is not held back waiting for a prefill of several)."""
        held = Counter(request.source for request in self._running)
        room = {source: min(len(queue), self.rows_per_source - held[source]) for source, queue in self._waiting.items()}
        return admission_order(room, free), sum(max(n, 0) for n in room.values())

    def _match_prefix(self, request: Request) -> None:
        """Find the request's longest cached prefix (all of its prompt but the last token at most) and pin it."""
        if self.prefix_cache is not None:
            request.cached, request.prefix = self.prefix_cache.match(request.input_ids[:-1])
            request.epoch = self.prefix_cache.epoch
            self.prefix_cache.pin(request.prefix)
        self.prompt_tokens["cached"] += request.cached
        self.prompt_tokens["prefilled"] += len(request.input_ids) - request.cached

    def _cache_prefixes(self, finished: list[tuple[Request, str, int | None]], row_of: dict[int, int]) -> None:
        """Keep the keys and values of requests leaving their rows (those that did not fail, from this
        cache epoch), unpin their prefixes, then evict down to the budget."""
        cache = self.prefix_cache
        if cache is None:
            return
        for request, _, _ in finished:
            row = row_of[id(request)]
            if request.error is None and request.epoch == cache.epoch:
                held = int(self.decoder.lengths[row]) - 1  # the last sampled token is not in the cache yet
                sequence = (request.input_ids + request.output_ids)[:held]
                cache.insert(sequence, functools.partial(self.decoder.read, row))
            if request.prefix is not None:
                cache.unpin(request.prefix)
        cache.evict()

    def _take(self, source: str) -> Request:
        """The next waiting request of ``source``; the source then waits behind the others."""
        queue = self._waiting.pop(source)
        request = queue.popleft()
        if queue:
            self._waiting[source] = queue
        return request

    def _prefill(self, first: int, requests: list[Request]) -> torch.Tensor:
        """Set the rows' sampling parameters and prefill their prompts: a request whose parameters the
        sampler cannot take fails in ``_advance`` as one whose prompt the model cannot run does, alone."""
        for row, request in enumerate(requests, start=first):
            params = request.params
            self.sampler.set(
                row, params.temperature, params.top_k, params.top_p, params.sampling_seed, len(request.input_ids)
            )
        cache = self.prefix_cache
        prefixes = [cache.segments(r.prefix) if r.cached else [] for r in requests] if cache else None
        return self.decoder.prefill(first, [r.input_ids for r in requests], prefixes)

    def _step(self) -> None:
        """Feed every running request its last token (the decoder keeps them): one more token each."""
        self._advance(0, self._running, lambda row, requests: self.decoder.decode(row, len(requests)))

    def _advance(
        self, first: int, requests: list[Request], forward: Callable[[int, list[Request]], torch.Tensor]
    ) -> None:
        """One forward pass over ``requests`` (in rows ``first``..), then sample and record a token each.
        If the pass raises, the rows run one at a time and only those that fail alone are failed:
        one bad row, or a batch too large for memory, never fails the others."""
        self.forward_passes += 1
        try:
            tokens, logprobs, finite = self.sampler.sample(forward(first, requests), first)
            errors = [None if ok else NOT_FINITE for ok in finite.tolist()]
        except Exception as exc:  # noqa: BLE001 - isolate the culprit below
            log.warning(
                "a step over %d rows failed (%s: %s); running them one at a time",
                len(requests),
                type(exc).__name__,
                exc,
            )
            rows = [self._advance_alone(row, request, forward) for row, request in enumerate(requests, start=first)]
            tokens, logprobs = torch.cat([t for t, _, _ in rows]), torch.cat([lp for _, lp, _ in rows])
            errors = [error for _, _, error in rows]
        self.decoder.push(first, tokens)
        self._record(requests, tokens.tolist(), logprobs.tolist(), errors)

    def _advance_alone(
        self, row: int, request: Request, forward: Callable[[int, list[Request]], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, str | None]:
        """``_advance`` for one row: its token, logprob and error (a pass that raises fails this row)."""
        try:
            tokens, logprobs, finite = self.sampler.sample(forward(row, [request]), row)
        except Exception as exc:  # noqa: BLE001 - this row fails by itself: fail its request
            device = self.decoder.device
            return (
                torch.zeros(1, dtype=torch.long, device=device),
                torch.zeros(1, device=device),
                f"{type(exc).__name__}: {exc}",
            )
        return tokens, logprobs, None if bool(finite[0]) else NOT_FINITE

    def _record(
        self, requests: list[Request], tokens: list[int], logprobs: list[float], errors: list[str | None]
    ) -> None:
        finished = []
        for request, token, logprob, error in zip(requests, tokens, logprobs, errors):
            if error is not None:
                request.error = f"{error} (output token {len(request.output_ids)})"
                if error == NOT_FINITE:
                    self.failing = request.error
                finished.append((request, "abort", None))
                continue
            self.failing = None
            request.output_ids.append(token)
            request.logprobs.append(logprob)
            request.versions.append(self.version)
            params = request.params
            if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
                finished.append((request, "stop", token))
            elif (
                len(request.output_ids) >= params.max_new_tokens
                or len(request.input_ids) + len(request.output_ids) >= self.context_length
            ):
                finished.append((request, "length", None))
        self._retire(finished)

    def _abort(self, which: Callable[[Request], bool]) -> None:
        self._retire([(r, "abort", None) for r in self._running if which(r)])
        with self._wake:
            aborted = [r for queue in self._waiting.values() for r in queue if which(r)]
            kept = {source: deque(r for r in queue if not which(r)) for source, queue in self._waiting.items()}
            self._waiting = {source: queue for source, queue in kept.items() if queue}
        for request in aborted:
            self._reply(request, "abort")

    def _retire(self, finished: list[tuple[Request, str, int | None]]) -> None:
        """Answer finished running requests and keep the rest in rows 0..n-1 (``compacted``), their rows
        moved in one copy per cache tensor."""
        row_of = {id(r): row for row, r in enumerate(self._running)}
        done = sum(request.error is None and reason != "abort" for request, reason, _ in finished)
        if done and self.gather_s > 0:  # their agents' next turns may follow: gather them (``_gathering``)
            with self._wake:
                now = time.monotonic()
                if not self._returning or now >= self._gather_end:
                    self._returning, self._gather_limit = 0, now + MAX_GATHERS * self.gather_s
                self._returning += done
                self._gather_end = min(now + self.gather_s, self._gather_limit)
        self._cache_prefixes(finished, row_of)
        for request, _, _ in finished:
            if request.error is not None:
                self.decoder.clear(row_of[id(request)])  # a NaN left there would reach later tenants
        kept = compacted(len(self._running), {row_of[id(request)] for request, _, _ in finished})
        for state in (self.decoder, self.sampler):
            state.move_rows(*row_moves(kept))
        self._running = [self._running[source] for source in kept]
        for request, reason, matched in finished:
            self._reply(request, reason, matched)

    def _reply(self, request: Request, reason: str, matched: int | None = None) -> None:
        request.on_done(
            Result(
                request.rid,
                request.output_ids,
                request.logprobs,
                request.versions,
                reason,
                matched,
                len(request.input_ids),
                self.version,
                request.error,
                request.cached,
            )
        )


def _split_block(block: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block of keys and values (``SlotDecoder.read``) cut after its first k positions, each part its
    own copy (so dropping one frees its memory)."""
    return block[:, :, :k].clone(), block[:, :, k:].clone()


def admission_order(room: dict[str, int], free: int) -> list[str]:
    """Round robin over sources: one request from each source with room, in the dict's order, then
    again, until ``free`` are picked or no source has room; a source is picked ``room[source]`` times at
    most. The picks differ by one at most between sources that still had room."""
    turns = deque(source for source, n in room.items() if n > 0)
    left, picked = dict(room), []
    while turns and len(picked) < free:
        source = turns.popleft()
        picked.append(source)
        left[source] -= 1
        if left[source]:
            turns.append(source)
    return picked


def compacted(count: int, finished: set[int]) -> list[int]:
    """The rows of a batch of ``count`` that stay once the ``finished`` rows leave, in their new order
    (rows 0..n-1): the last row moves into each freed row, highest freed rows first, so a row that stays
    below the new count never moves."""
    rows = list(range(count))
    for row in sorted(finished, reverse=True):
        rows[row] = rows[-1]
        rows.pop()
    return rows


def row_moves(kept: list[int]) -> tuple[list[int], list[int]]:
    """(sources, targets): the rows whose sequences ``compacted`` moves, and where to."""
    moved = [row for row, source in enumerate(kept) if source != row]
    return [kept[row] for row in moved], moved


def _release_openmp_threads() -> None:
    """Free the calling thread's OpenMP worker pool, so the engine thread's pool is the only one.

    With two pools alive (the caller's, e.g. from loading the model or running ``generate()``, and the
    engine thread's), libgomp counts more threads than cores and stops spin-waiting between parallel
    regions: every torch op then waits for a futex wake-up, which made a decode step on the engine
    thread 2.6x slower at batch 1 on 2 cores. The caller's pool is rebuilt if it computes again.
    """
    try:
        ctypes.CDLL("libgomp.so.1").omp_pause_resource_all(2)  # omp_pause_hard
    except (OSError, AttributeError):
        pass  # no libgomp (another OpenMP runtime, or none): nothing to release
