"""``areal-hpc repro dta``: AReaL-DTA's headline numbers beside ours, on synthetic batches shaped like the
paper's, and the measurement ``bench/tree_training.py`` shares.

Workloads (token ids drawn at random; lengths log-normal with spread 0.5 around the stated means):
- GRPO groups: ``samples`` completions of one prompt per group; each completion is a training sequence.
- Multi-turn episodes (τ²-bench-like): per group one task, a shared system prompt and first user
  message, then ``episodes`` rollouts of 5-30 turns, each an assistant reply followed by a user/tool
  message; every turn is a training sequence (the context so far + that reply, only the reply
  trained), as an agent's per-call records are, so a turn's sequence is a prefix of the next one's.

Each training variant runs in its own process, one thread, the model built there from a preset
(random weights, long positions): flat (the torch engine's packed micro-batches), dta (the same
engine with ``tree_training=dta``) and a tree mask (the whole tree as one packed sequence, each token
attending to its ancestors through a dense 4D mask: the "sparse tree mask" baseline, which computes
each tree token once but pays the full T×T mask). Times are medians of optimizer steps after a warm-up;
peak memory is the process's largest resident set during the warm-up and the steps over what it held
before them (the model and its optimizer built).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

PAPER = {"compression": 9.43, "vs_dense": 8.31, "vs_tree_mask": (1.52, 1.70)}
VOCAB = 1024
MODES = ("flat", "dta", "tree-mask")


@dataclass(frozen=True)
class Workload:
    kind: str  # "grpo" or "multi-turn"
    groups: int
    samples: int  # completions per prompt, or episodes per task
    prompt: int  # GRPO prompt, or the system prompt + first user message
    reply: float  # mean completion / assistant reply length
    environment: float = 0.0  # mean user/tool message length (multi-turn)
    turns: tuple[int, int] = (5, 30)
    spread: float = 0.5  # of the log-normal lengths; 0: every reply and message exactly its mean
    seed: int = 0

    def sequences(self) -> tuple[list[list[int]], list[list[int]]]:
        """(token sequences, loss masks)."""
        rng = np.random.default_rng(self.seed)

        def tokens(mean: float) -> list[int]:
            n = max(1, round(rng.lognormal(np.log(mean), self.spread))) if mean else 0
            return rng.integers(3, VOCAB, n).tolist()

        sequences, masks = [], []
        for _ in range(self.groups):
            shared = rng.integers(3, VOCAB, self.prompt).tolist()
            for _ in range(self.samples):
                context = shared
                for _ in range(1 if self.kind == "grpo" else int(rng.integers(self.turns[0], self.turns[1] + 1))):
                    reply = tokens(self.reply)
                    sequences.append(context + reply)
                    masks.append([0] * len(context) + [1] * len(reply))
                    context = context + reply + tokens(self.environment)
        return sequences, masks


@dataclass(frozen=True)
class RecordedWorkload:
    """A batch as a run trained it (read back from its shards): sequences and loss masks as they are."""

    token_sequences: tuple[tuple[int, ...], ...]
    loss_masks: tuple[tuple[int, ...], ...]
    seed: int = 0

    def sequences(self) -> tuple[list[list[int]], list[list[int]]]:
        return [list(s) for s in self.token_sequences], [list(m) for m in self.loss_masks]


def grpo(samples: int, prompt: int, reply: float, groups: int = 2, spread: float = 0.5, seed: int = 0) -> Workload:
    return Workload("grpo", groups, samples, prompt, reply, spread=spread, seed=seed)


def multi_turn(
    episodes: int,
    prompt: int,
    reply: float,
    environment: float,
    groups: int = 1,
    turns: tuple[int, int] = (5, 30),
    seed: int = 0,
) -> Workload:
    return Workload("multi-turn", groups, episodes, prompt, reply, environment, turns, seed=seed)


def compression(workload: Workload | RecordedWorkload) -> float:
    from areal_hpc.algo.prefix_tree import build_prefix_tree

    return build_prefix_tree(workload.sequences()[0]).compression


def training_batch(workload: Workload | RecordedWorkload):
    """The workload as a PPO minibatch: behaviour logprobs and advantages at random, token-mean weights."""
    import torch

    from areal_hpc.algo.ppo import token_weights
    from areal_hpc.engines.sequence_batch import SequenceBatch

    sequences, masks = workload.sequences()
    generator = torch.Generator().manual_seed(workload.seed)
    batch = SequenceBatch(
        sequences,
        masks,
        {
            "advantages": [torch.randn(1, generator=generator).expand(len(s)).clone() for s in sequences],
            "behav_logprobs": [-6.0 + 0.1 * torch.randn(len(s), generator=generator) for s in sequences],
        },
    )
    packed, _ = batch.packed()
    batch.set_packed(
        "weights",
        token_weights(packed.target_mask, packed.cu_seqlens, "token-mean", packed.n_targets, len(sequences), 0),
    )
    return batch


class PeakResidentSet:
    """The largest resident set of this process while in the block, sampled every millisecond."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def __enter__(self):
        self.peak = self.now()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def _measure(mode: str, workload: Workload | RecordedWorkload, preset: str, steps: int, max_tokens: int) -> dict:
    """In a fresh process: seconds per optimizer step (median) and peak memory over the start."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_hpc.config import ActorConfig, OptimizerConfig
    from areal_hpc.engines.torch.engine import TorchTrainEngine
    from areal_hpc.engines.torch.outputs import PolicyOutputs
    from areal_hpc.models.tiny import PRESETS
    from areal_hpc.train.actor import PPOActor

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=VOCAB, max_position_embeddings=8192, tie_word_embeddings=True, **PRESETS[preset])
    )
    engine = TorchTrainEngine(
        model,
        PolicyOutputs(1.0),
        lr=1e-5,
        optimizer=OptimizerConfig(),
        max_tokens_per_mb=max_tokens,
        tree_training="dta" if mode == "dta" else "off",
    )
    loss = PPOActor(engine, ActorConfig())._policy_loss
    batch = training_batch(workload)
    step = (
        (lambda: tree_mask_step(engine, batch, loss))
        if mode == "tree-mask"
        else (lambda: engine.train_step(batch, loss))
    )
    times = []
    with PeakResidentSet() as memory:
        before = PeakResidentSet.now()
        step()  # warm-up, untimed
        for _ in range(steps):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
    return {
        "seconds": statistics.median(times),
        "peak_bytes": memory.peak - before,
        "sequence_tokens": sum(map(len, batch.sequences)),
    }


def tree_mask_step(engine, batch, loss_fn) -> None:
    """One optimizer step with the whole prefix tree as one packed sequence under a dense tree mask."""
    import torch

    from areal_hpc.algo.prefix_tree import build_prefix_tree
    from areal_hpc.engines.torch.tree import PackedFields, chunk_pieces

    tree = build_prefix_tree(batch.sequences)
    tokens = torch.tensor([[t for node in tree.nodes for t in node.tokens]])
    offsets = np.cumsum([0] + [len(node.tokens) for node in tree.nodes])
    positions = torch.tensor([[node.start + k for node in tree.nodes for k in range(len(node.tokens))]])
    visible = torch.zeros(tokens.shape[1], tokens.shape[1], dtype=torch.bool)
    for n, node in enumerate(tree.nodes):  # each token sees its ancestors' tokens and its own segment's earlier ones
        rows = slice(offsets[n], offsets[n + 1])
        visible[rows, rows] = torch.ones(len(node.tokens), len(node.tokens), dtype=torch.bool).tril()
        ancestor = node.parent
        while ancestor >= 0:
            visible[rows, offsets[ancestor] : offsets[ancestor + 1]] = True
            ancestor = tree.nodes[ancestor].parent
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    model, head = engine.model, engine.root.forward_fn.head
    engine.optimizer.zero_grad(set_to_none=True)
    hidden = model.base_model(input_ids=tokens, position_ids=positions, attention_mask=mask).last_hidden_state[0]
    total, whole = 0.0, PackedFields.of(batch)
    for n, node in enumerate(tree.nodes):  # each node's pieces, read off its rows of the one forward
        pieces = chunk_pieces(tree, [[n]], batch, len(node.tokens), whole)
        if pieces is not None:
            rows, packed, fields = pieces
            padded = torch.cat([hidden[offsets[n] : offsets[n + 1]], hidden.new_zeros(1, hidden.shape[1])])
            total = total + loss_fn(head(model, padded[torch.tensor(rows)], packed), packed, fields)[0]
    total.backward()
    engine.optimizer.step()


MEASURE_PRELOAD = (
    "torch",
    "transformers.models.qwen2.modeling_qwen2",
    "areal_hpc.engines.torch.engine",
    "areal_hpc.train.actor",
)


def measure(
    mode: str, workload: Workload | RecordedWorkload, preset: str = "small", steps: int = 3, max_tokens: int = 4096
) -> dict:
    """``_measure`` in a child process (its own allocator and peak), one torch thread. The children fork
    from one server that has imported what they use (``MEASURE_PRELOAD``): each starts in a fraction
    of a second instead of ~3 s, as fresh for what is measured as a spawned interpreter."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; valid: {', '.join(MODES)}")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(MEASURE_PRELOAD))
    with context.Pool(1) as pool:
        return pool.apply(_measure, (mode, workload, preset, steps, max_tokens))


@dataclass(frozen=True)
class DtaRow:
    row: str
    paper: float | None
    ours: float
    workload: str

    @property
    def ratio(self) -> float | None:
        return None if self.paper is None else self.ours / self.paper

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


# τ²-bench-like at the paper's scale (assumed: a 1,500-token system prompt and task, 8 episodes per task,
# 60-token user/tool messages, 80-token replies), for the compression alone; and scaled to a CPU for training.
TAU2_LIKE = multi_turn(episodes=8, prompt=1500, reply=80, environment=60, groups=4)
TIMED = {
    "multi-turn": multi_turn(episodes=4, prompt=192, reply=16, environment=16),
    "GRPO n=8": grpo(8, prompt=128, reply=32),
    "GRPO n=16": grpo(16, prompt=128, reply=32),
}
QUICK = {
    "multi-turn": multi_turn(episodes=2, prompt=32, reply=8, environment=8, turns=(3, 5)),
    "GRPO n=8": grpo(8, prompt=32, reply=8),
}  # a check that it runs, in seconds


def dta_rows(preset: str = "small", steps: int = 3, timed: dict[str, Workload] = TIMED, progress=print) -> list[DtaRow]:
    """The table: compression, tree vs flat and tree vs tree mask, beside the paper."""
    rows = [DtaRow("token compression, τ²-bench", PAPER["compression"], compression(TAU2_LIKE), describe(TAU2_LIKE))]
    runs = [(name, mode) for name in timed for mode in (MODES if name == "multi-turn" else MODES[:2])]
    seconds: dict[tuple[str, str], float] = {}
    for k, (name, mode) in enumerate(runs):
        progress(f"[{k + 1}/{len(runs)}] {name}: {mode}")
        seconds[name, mode] = measure(mode, timed[name], preset, steps)["seconds"]
    for name, workload in timed.items():
        label = f"{describe(workload)}, compression {compression(workload):.2f}"
        rows.append(
            DtaRow(
                f"training speed-up vs flat, {name}",
                PAPER["vs_dense"] if name == "multi-turn" else None,
                seconds[name, "flat"] / seconds[name, "dta"],
                label,
            )
        )
        if (name, "tree-mask") in seconds:
            rows.append(
                DtaRow(
                    f"training speed-up vs tree mask, {name}",
                    sum(PAPER["vs_tree_mask"]) / 2,
                    seconds[name, "tree-mask"] / seconds[name, "dta"],
                    label,
                )
            )
    return rows


def describe(workload: Workload) -> str:
    if workload.kind == "grpo":
        return f"{workload.groups} prompts x {workload.samples}, prompt {workload.prompt}, replies ~{workload.reply:g}"
    return (
        f"{workload.groups} tasks x {workload.samples} episodes of {workload.turns[0]}-{workload.turns[1]} turns, "
        f"prompt {workload.prompt}, replies ~{workload.reply:g}, messages ~{workload.environment:g}"
    )


NOTES = [
    "the paper's speed-ups are on GPUs (1.7B/8B models, τ²-bench's real episodes) against dense training with "
    "activation checkpointing; ours are one CPU thread on the 'small' preset (6 layers, hidden 256) against the flat "
    "engine without checkpointing, at lengths scaled down about 8x: the ratio, not the absolute, is comparable",
    "the tree-mask baseline is a dense T x T mask over the tree's tokens (the paper's is a sparse-mask kernel): on a "
    "CPU it pays for every masked pair, so it favours us",
    "the τ²-bench compression depends on the assumed lengths: longer system prompts and more turns compress more",
]
