"""HexGen-style cost model: rollout replica throughput, training step time, weight sync, memory.

Each phase is a roofline on the device's datasheet figures (``hardware.CATALOGUE``) times an efficiency
factor from ``Efficiency``, which ``areal_hpc.sched.calibrate`` fits to measured runs:

- prefill of a prompt: max(2·params·prompt FLOPs / FLOP/s, its weights read once / HBM bytes/s);
- decode step of ``b`` running sequences: max((weights + b contexts of KV) / HBM, 2·params·b / FLOP/s), plus
  the TP all-reduces and PP sends of ``b`` hidden vectors; ``b`` is at most the slots the KV cache holds
  (``memory.rollout_slots``), so a device with little memory runs small, weight-bound batches;
- training: 8·params FLOPs per token (forward and backward, and the forward of the proximal log-probs) at
  the training FLOP/s, stretched by the pipeline bubble, plus TP all-reduces and PP sends per micro-batch;
- weight sync: the bf16 weights over the slowest link from a trainer to a rollout replica.

The same global factors hold for every device, so a device low on FLOP/s and high on HBM bandwidth (H20:
148 TFLOP/s, 4.0 TB/s) comes out good at decode, compute-bound at large batches, and slow to train.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from importlib.resources.abc import Traversable

from areal_hpc.errors import UserError, closest
from areal_hpc.layout import ParallelDims
from areal_hpc.sched.hardware import CATALOGUE, NodePool, read_yaml
from areal_hpc.sched.memory import (
    GB,
    MemoryEstimate,
    Precision,
    TrainLayout,
    kv_shards,
    rollout_estimate,
    rollout_slots,
    train_estimate,
)
from areal_hpc.sched.model_spec import ModelSpec

# What the planner assumes of a trainer: Megatron-LM's defaults for mixed precision (bfloat16 weights and
# gradients, float32 master weights and moments), its distributed optimizer, full activation recomputation.
MEGATRON_MIXED = Precision("bfloat16", "bfloat16", "float32", "bfloat16")


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the rooflines that real kernels and collectives reach (the calibrated parameters)."""

    train_mfu: float = 0.35  # training matmuls, of peak bf16 FLOP/s
    prefill_mfu: float = 0.5  # rollout prefill, of peak bf16 FLOP/s
    decode_mfu: float = 0.5  # decode compute ceiling at large batches
    decode_hbm: float = 0.6  # decode reads of weights and KV, of HBM bandwidth
    link: float = 0.7  # collectives and pipeline sends, of link bandwidth
    sync: float = 0.16  # weight update (gather, send, load), of the slowest train->rollout link
    latency_s: float = 10e-6  # fixed cost of one collective
    overall: float = 1.0  # end-to-end share of the above a whole system keeps (scheduling gaps,
    #                              stragglers, host overheads); scales every compute and HBM rate
    per_device: tuple[tuple[str, float], ...] = ()  # ("H20.train", 0.6), ("H20.decode", 0.9): one device
    #                              type's training (or decode) speed relative to the factors above; 1 if absent

    def factor(self, name: str) -> float:
        """A factor by name: a field (``overall``) or a device type's ``TYPE.train`` / ``TYPE.decode``."""
        if "." in name:
            return dict(self.per_device).get(name, 1.0)
        return getattr(self, name)

    def replace(self, **values) -> Efficiency:
        """A copy with factors replaced; names as in ``factor``."""
        devices = dict(self.per_device) | {k: float(v) for k, v in values.items() if "." in k}
        plain = {f.name: getattr(self, f.name) for f in fields(self)} | {
            k: v for k, v in values.items() if "." not in k
        }
        return Efficiency(**{**plain, "per_device": tuple(sorted(devices.items()))})


DEVICE_SIDES = ("train", "decode")


def load_efficiency(path: str | Traversable) -> Efficiency:
    """Factors from a YAML mapping (e.g. areal_hpc/sched/catalog/efficiency-areal-hex.yaml); the rest default.

    ``per_device: {H20: {train: 0.6, decode: 0.9}}`` scales one device type against the global factors.
    """
    values = read_yaml(path, "efficiency file", "see areal_hpc/sched/catalog/efficiency-areal-hex.yaml") or {}
    if not isinstance(values, dict):
        raise UserError(f"efficiency file {path} must map factor names to numbers")
    known = [f.name for f in fields(Efficiency)]
    for key in values:
        if key not in known:
            raise UserError(
                f"{path}: unknown efficiency factor '{key}'{closest(str(key), known)} (known: {', '.join(known)})"
            )
    per_device = values.pop("per_device", None) or {}
    flat = {}
    for device, sides in per_device.items() if isinstance(per_device, dict) else [(per_device, None)]:
        if not isinstance(sides, dict) or not set(sides) <= set(DEVICE_SIDES):
            raise UserError(
                f"{path}: per_device must map device types to {{train: x, decode: y}}, got {device}: {sides}"
            )
        if device not in CATALOGUE:
            raise UserError(
                f"{path}: per_device names unknown device type '{device}'{closest(str(device), CATALOGUE)} "
                f"(known: {', '.join(CATALOGUE)})"
            )
        flat |= {f"{device}.{side}": v for side, v in sides.items()}
    try:
        return Efficiency().replace(**{k: float(v) for k, v in (values | flat).items()})
    except (TypeError, ValueError):
        raise UserError(f"{path}: efficiency factors must be numbers, got {values | flat}") from None


@dataclass(frozen=True)
class Workload:
    """One RL step: ``prompts`` x ``answers`` sequences of a prompt plus a generated answer."""

    prompts: int = 64
    answers: int = 16
    prompt_len: int = 512
    gen_mean: int = 4096
    gen_max: int = 8192
    max_running: int = 256  # concurrent sequences per rollout replica (SGLang's max_running_requests)
    micro_tokens: int = 16384  # training micro-batch, tokens

    @property
    def sequences(self) -> int:
        return self.prompts * self.answers

    @property
    def seq_tokens(self) -> int:
        return self.prompt_len + self.gen_mean

    @property
    def step_tokens(self) -> int:
        return self.sequences * self.seq_tokens


@dataclass(frozen=True)
class RolloutReplica:
    """A replica configuration ψ: ``tp`` x ``pp`` devices of one pool, ``batch`` running sequences."""

    pool: str
    tp: int
    pp: int
    batch: int
    tokens_per_s: float
    price_per_hour: float
    step_1_s: float  # one decode iteration with a single sequence running
    step_full_s: float  # ... and with ``batch`` running

    @property
    def devices(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class PoolTrainLayout:
    """Training devices of one pool: dp x tp x pp, its token rate and its per-step gradient all-reduce."""

    pool: str
    dp: int
    tp: int
    pp: int
    tokens_per_s: float
    allreduce_s: float

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp


def powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


class CostModel:
    """Predicted speeds of one model and workload on any device pool."""

    def __init__(self, model: ModelSpec, workload: Workload = Workload(), efficiency: Efficiency = Efficiency()):
        self.model, self.workload, self.eff = model, workload, efficiency
        self.rollout_replica = lru_cache(maxsize=None)(self._rollout_replica)
        self.train_layouts = lru_cache(maxsize=None)(self._train_layouts)
        self.train_group = lru_cache(maxsize=None)(self._train_group)

    def _collective_s(self, nbytes: float, ranks: int, gbs: float) -> float:
        """Ring all-reduce of ``nbytes`` over ``ranks`` ranks on links of ``gbs`` GB/s."""
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) / ranks * nbytes / (gbs * GB * self.eff.link) + self.eff.latency_s

    def _rollout_replica(self, pool: NodePool, tp: int, pp: int, inter_gbs: float) -> RolloutReplica | None:
        """Throughput of one rollout replica, or None when the weights leave no room for a KV cache."""
        m, w, dev = self.model, self.workload, pool.device
        n = tp * pp
        batch = min(w.max_running, rollout_slots(m, dev.memory_gb * GB, tp, pp, w.seq_tokens))
        if batch < 1 or pp > m.layers:
            return None
        seconds = batch * self.prefill_s(pool, tp, pp) + w.gen_mean * self.decode_step_s(pool, tp, pp, batch, inter_gbs)
        return RolloutReplica(
            pool.name,
            tp,
            pp,
            batch,
            batch * w.seq_tokens / seconds,
            n * dev.price_per_hour,
            self.decode_step_s(pool, tp, pp, 1, inter_gbs),
            self.decode_step_s(pool, tp, pp, batch, inter_gbs),
        )

    def prefill_s(self, pool: NodePool, tp: int, pp: int) -> float:
        """One prompt's prefill on a replica: its FLOPs, or one read of each device's weights if slower
        (short prompts); the pp stages work on successive prompts, so all ``tp·pp`` devices count."""
        m, w, e, dev = self.model, self.workload, self.eff, pool.device
        compute_s = 2 * m.params * w.prompt_len / (tp * pp * dev.tflops * 1e12 * e.prefill_mfu * e.overall)
        memory_s = m.weight_bytes / (tp * pp) / (dev.hbm_gbs * GB * e.decode_hbm * e.overall)
        return max(compute_s, memory_s)

    def decode_step_s(self, pool: NodePool, tp: int, pp: int, running: int, inter_gbs: float) -> float:
        """One decode iteration of a replica with ``running`` sequences (one new token each): HBM-bound on
        the weights and the KV cache read, or compute-bound at large ``running`` on a device with few FLOP/s."""
        m, w, e, dev = self.model, self.workload, self.eff, pool.device
        n = tp * pp
        context = w.prompt_len + w.gen_mean / 2
        # Each of the pp micro-batches reads its stage's weights, so PP does not cut weight reads.
        read = m.weight_bytes / tp + running * m.kv_bytes(context) / kv_shards(m, tp, pp)
        device = e.overall * e.factor(f"{dev.name}.decode")
        memory_s = read / (dev.hbm_gbs * GB * e.decode_hbm * device)
        compute_s = 2 * m.params * running / n / (dev.tflops * 1e12 * e.decode_mfu * device)
        tp_s = 2 * m.layers / pp * self._collective_s(running * m.hidden * 2, tp, dev.link_gbs)
        pp_gbs = dev.link_gbs if n <= pool.per_node else inter_gbs
        pp_s = (pp - 1) * (running * m.hidden * 2 / (pp_gbs * GB * e.link) + e.latency_s)
        return max(memory_s, compute_s) + tp_s + pp_s

    def rollout_replicas(self, pool: NodePool, devices: int, inter_gbs: float) -> list[RolloutReplica]:
        """Every feasible replica configuration of at most ``devices`` devices of ``pool``."""
        found = []
        for tp in powers_of_two(pool.per_node):
            for pp in powers_of_two(devices // tp):
                replica = self.rollout_replica(pool, tp, pp, inter_gbs)
                if replica is not None:
                    found.append(replica)
        return found

    def train_memory(self, dp: int, tp: int, pp: int) -> MemoryEstimate:
        """A trainer rank's memory in a dp x tp x pp group, as the planner assumes trainers run (``MEGATRON_MIXED``)."""
        layout = TrainLayout(
            ParallelDims(dp=dp, tp=tp, pp=pp),
            MEGATRON_MIXED,
            self.workload.micro_tokens,
            recompute="full",
            shard_optimizer=True,
        )
        return train_estimate(self.model, layout)

    def rollout_memory(self, replica: RolloutReplica) -> MemoryEstimate:
        """A device's memory in a rollout replica: its ``batch`` sequences of prompt and mean answer."""
        return rollout_estimate(self.model, replica.tp, replica.pp, replica.batch, self.workload.seq_tokens)

    def _train_layouts(self, pool: NodePool, devices: int, inter_gbs: float) -> tuple[PoolTrainLayout, ...]:
        """Every dp x tp x pp layout of exactly ``devices`` devices of ``pool`` that fits in memory."""
        m, w, e, dev = self.model, self.workload, self.eff, pool.device
        found = []
        for tp in powers_of_two(min(pool.per_node, m.heads)):
            for pp in range(1, min(devices // tp, m.layers) + 1):
                dp, rest = divmod(devices, tp * pp)
                if rest or not self.train_memory(dp, tp, pp).fits(dev.memory_gb * GB):
                    continue
                micro_batches = max(1.0, w.step_tokens / dp / w.micro_tokens)
                # 8 = 6 (forward + backward) + 2 (forward that recomputes the proximal log-probs)
                bubble = 1 + (pp - 1) / micro_batches
                flops = dev.tflops * 1e12 * e.train_mfu * e.overall * e.factor(f"{dev.name}.train")
                compute = 8 * m.params / (tp * pp * flops) * bubble
                # per token: 4 all-reduces a layer (2 forward, 2 backward), each run once per micro-batch
                tp_comm = (
                    4
                    * m.layers
                    / pp
                    * self._collective_s(w.micro_tokens * m.hidden * 2, tp, dev.link_gbs)
                    / w.micro_tokens
                )
                pp_gbs = dev.link_gbs if tp * pp <= pool.per_node else inter_gbs
                pp_comm = (pp > 1) * 2 * m.hidden * 2 / (pp_gbs * GB * e.link)
                dp_gbs = dev.link_gbs if devices <= pool.per_node else inter_gbs
                found.append(
                    PoolTrainLayout(
                        pool.name,
                        dp,
                        tp,
                        pp,
                        dp / (compute + tp_comm + pp_comm),
                        self._collective_s(m.weight_bytes / (tp * pp), dp, dp_gbs),
                    )
                )
        return tuple(found)

    def _train_group(self, pool: NodePool, devices: int, inter_gbs: float) -> PoolTrainLayout | None:
        """The layout of ``devices`` devices of ``pool`` with the shortest step alone (None: nothing fits)."""
        return min(self.train_layouts(pool, devices, inter_gbs), key=self._group_step_s, default=None)

    def _group_step_s(self, group: PoolTrainLayout) -> float:
        return self.workload.step_tokens / group.tokens_per_s + group.allreduce_s

    def fastest_train(
        self, layouts: list[tuple[PoolTrainLayout, ...]], cross_gbs: float
    ) -> tuple[tuple[PoolTrainLayout, ...], float]:
        """One layout per pool (from ``layouts``, one tuple per pool) whose combined ``train_step_s`` is
        shortest, and that step.

        A pool's fastest layout alone is not always best together: the step is (B + Σ a·r) / Σ r (a a
        group's all-reduce time, r its token rate) plus a term no layout changes. Dinkelbach's iteration
        minimises that ratio exactly: at ratio λ every pool takes the layout minimising r·(a − λ) on its
        own; the chosen layouts' ratio is the next λ, until it stops falling.
        """

        def ratio(groups) -> float:
            return (self.workload.step_tokens + sum(g.allreduce_s * g.tokens_per_s for g in groups)) / sum(
                g.tokens_per_s for g in groups
            )

        chosen = [min(options, key=self._group_step_s) for options in layouts]
        while True:
            at = ratio(chosen)
            step = [min(options, key=lambda g: g.tokens_per_s * (g.allreduce_s - at)) for options in layouts]
            if ratio(step) >= at * (1 - 1e-12):
                return tuple(chosen), self.train_step_s(chosen, cross_gbs)
            chosen = step

    def train_step_s(self, groups: list[PoolTrainLayout], cross_gbs: float) -> float:
        """One step over groups of different pools: tokens split so that all finish together, then
        the groups' gradients are averaged over the slowest link between them."""
        rate = sum(g.tokens_per_s for g in groups)
        balanced = (self.workload.step_tokens + sum(g.allreduce_s * g.tokens_per_s for g in groups)) / rate
        return balanced + self._collective_s(self.model.weight_bytes, len(groups), cross_gbs)

    def weight_sync_s(self, slowest_gbs: float) -> float:
        """Push bf16 weights from the trainer to every rollout replica over the slowest link between them."""
        return self.model.weight_bytes / (slowest_gbs * GB * self.eff.sync)
