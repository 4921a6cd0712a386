"""``areal-hpc plan | simulate | repro``: the planner's subcommands (login-node safe: no torch), each as the
function that declares its arguments and the one that runs it; ``areal_hpc/cli.py`` lists them in its table.

    areal-hpc plan --cluster paper-8h800-24h20 --model r1-distill-qwen-7b
    areal-hpc simulate --plan plan.yaml --staleness 0
    areal-hpc repro hex [--json]            areal-hpc repro areal-eta [--json]
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from areal_hpc import builtins
from areal_hpc.errors import UserError


def plan_arguments(plan) -> None:
    """Declare ``plan``'s arguments on its parser."""
    plan.add_argument(
        "--cluster",
        required=True,
        metavar="NAME",
        help="a cluster of the shipped catalog (e.g. paper-8h800-24h20, example-site) or a cluster YAML",
    )
    plan.add_argument(
        "--model",
        required=True,
        metavar="NAME",
        help="a model of the shipped catalog (e.g. r1-distill-qwen-7b) or a folder with a config.json",
    )
    plan.add_argument("--budget-per-hour", type=float, metavar="USD", help="spend at most this much per hour")
    plan.add_argument("--objective", default="max-throughput", choices=["max-throughput", "min-cost"])
    plan.add_argument("--target-throughput", type=float, metavar="TOKENS_PER_S", help="for --objective min-cost")
    plan.add_argument("--staleness", type=int, default=4, metavar="ETA", help="max policy-version lag (0: sync RL)")
    plan.add_argument("--sequences", type=int, default=1024, help="sequences per RL step (default: 1024)")
    plan.add_argument("--prompt-len", type=int, default=512, help="mean prompt tokens (default: 512)")
    plan.add_argument("--answer-len", type=int, default=4096, help="mean answer tokens (default: 4096)")
    plan.add_argument("--efficiency", metavar="FILE", help="YAML of efficiency factors (e.g. from a calibration)")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.add_argument("--out", metavar="FILE", help="also write the plan as YAML (input of `simulate`, the launcher)")
    plan.add_argument("--plot", metavar="PNG", help="also draw the plan")


def simulate_arguments(sim) -> None:
    """Declare ``simulate``'s arguments on its parser."""
    sim.add_argument("--plan", required=True, metavar="FILE", help="a plan YAML written by `areal-hpc plan --out`")
    sim.add_argument("--staleness", type=int, metavar="ETA", help="override the plan's staleness bound")
    sim.add_argument("--steps", type=int, default=20, help="training steps to simulate (default: 20)")
    sim.add_argument("--spread", type=float, default=0.6, help="log-normal spread of answer lengths (0: all equal)")
    sim.add_argument("--not-interruptible", action="store_true", help="weight updates wait for in-flight answers")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", action="store_true", help="print one JSON object")


def repro_arguments(paper) -> None:
    """Declare the arguments every ``repro PAPER`` takes on its parser."""
    paper.add_argument("--json", action="store_true", help="one JSON object per row")
    paper.add_argument(
        "--calibrate", action="store_true", help="refit the efficiency factors to the rows marked 'fit' first (minutes)"
    )


def repro_hex_arguments(paper) -> None:
    """Declare ``repro hex``'s arguments: those of every paper and the workload's size."""
    repro_arguments(paper)
    paper.add_argument("--sequences", type=int, help="sequences per step (default: the assumed 64)")


def _positive(value, flag: str, what: str) -> None:
    if value is not None and not value > 0:
        raise UserError(f"{flag} must be a positive {what}, got {value:g}")


def run_plan(args) -> int:
    import yaml

    from areal_hpc.sched.cost import CostModel, Efficiency, Workload, load_efficiency
    from areal_hpc.sched.hardware import load_cluster
    from areal_hpc.sched.model_spec import load_model_spec
    from areal_hpc.sched.planner import HeteroPlanner
    from areal_hpc.sched.report import plan_dict, plan_text, plot_plan

    _positive(args.budget_per_hour, "--budget-per-hour", "number of dollars per hour")
    _positive(args.target_throughput, "--target-throughput", "number of tokens/s")
    for flag in ("sequences", "prompt_len", "answer_len"):
        _positive(getattr(args, flag), f"--{flag.replace('_', '-')}", "whole number")
    if args.staleness < 0:
        raise UserError(f"--staleness must be 0 (synchronous) or more, got {args.staleness}")
    if args.target_throughput and args.objective != "min-cost":
        raise UserError("--target-throughput goes with --objective min-cost (max-throughput has no target)")
    cluster, model = load_cluster(args.cluster), load_model_spec(args.model)
    workload = Workload(
        prompts=args.sequences,
        answers=1,
        prompt_len=args.prompt_len,
        gen_mean=args.answer_len,
        gen_max=2 * args.answer_len,
    )
    efficiency = load_efficiency(args.efficiency) if args.efficiency else Efficiency()
    cost = CostModel(model, workload, efficiency)
    planner = HeteroPlanner(
        cluster, cost, args.staleness, args.budget_per_hour or math.inf, args.objective, args.target_throughput
    )
    plan = planner.plan()
    record = plan_dict(plan, cluster, model.name, workload)
    record["memory"] = plan_memory(plan, cost, cluster)
    print(json.dumps(record) if args.json else plan_text(record) + "\n\n" + memory_text(record["memory"]))
    try:
        if args.out:
            Path(args.out).write_text(yaml.safe_dump(record, sort_keys=False))
        if args.plot:
            plot_plan(record, args.plot)
    except OSError as exc:
        raise UserError(f"cannot write {exc.filename}: {exc.strerror}") from None
    return 0


def plan_memory(plan, cost, cluster) -> list[dict]:
    """Per role of ``plan``: one device's estimated memory (GB, by kind) and whether it fits that device."""
    from areal_hpc.sched.memory import GB

    devices = {p.name: p.device for p in cluster.pools}
    roles = [(f"train dp{g.dp} tp{g.tp} pp{g.pp}", g.pool, cost.train_memory(g.dp, g.tp, g.pp)) for g in plan.train]
    roles += [
        (f"rollout tp{r.tp} pp{r.pp} x{r.batch} seqs", r.pool, cost.rollout_memory(r)) for r, _ in plan.rollout.replicas
    ]
    return [
        {
            "role": role,
            "pool": pool,
            "device": devices[pool].name,
            "device_gb": devices[pool].memory_gb,
            **{kind: round(value / GB, 2) for kind, value in estimate.breakdown().items()},
            "fits": estimate.fits(devices[pool].memory_gb * GB),
        }
        for role, pool, estimate in roles
    ]


def memory_text(rows: list[dict]) -> str:
    from areal_hpc.sched.memory import RESERVE_FRACTION
    from areal_hpc.sched.report import table

    kinds = ["params", "grads", "optimizer", "activations", "kv_cache", "total"]
    body = [
        [
            r["role"],
            r["device"],
            *(f"{r.get(k, 0):.1f}" for k in kinds),
            f"{'yes' if r['fits'] else 'NO'} ({r['device_gb'] * (1 - RESERVE_FRACTION):.0f} of {r['device_gb']:.0f})",
        ]
        for r in rows
    ]
    return (
        f"memory per device, GB (estimated; {RESERVE_FRACTION:.0%} of each device kept for the framework):\n"
        + table(["role", "device", *kinds, "fits"], body)
    )


def check_run_memory(cfg, device: str, logits_chunk_bytes: int) -> str:
    """``submit --check-memory DEVICE``: a trainer rank and a rollout server of ``cfg`` on a device of the
    catalogue (H100, ...) or of DEVICE GB; raises ``UserError`` (one line: what, how much, what would fit)
    for one that cannot fit, else says what each needs. ``logits_chunk_bytes``: the log-softmax's chunk
    of float32 logits (``algo.logprobs``: the caller imports it; this module stays free of torch)."""
    from areal_hpc.layout import MixedLayout
    from areal_hpc.sched.hardware import CATALOGUE
    from areal_hpc.sched.memory import (
        GB,
        Precision,
        TrainLayout,
        largest_micro_tokens,
        rollout_estimate,
        rollout_slots,
        train_estimate,
        usable_bytes,
    )
    from areal_hpc.sched.model_spec import load_model_spec

    if device in CATALOGUE:
        device_bytes = CATALOGUE[device].memory_gb * GB
    else:
        try:
            device_bytes = float(device.upper().removesuffix("GB").removesuffix("G")) * GB
        except ValueError:
            device_bytes = 0.0
        if not device_bytes > 0:
            raise UserError(
                f"--check-memory {device!r} is neither a device type ({', '.join(CATALOGUE)}) nor a "
                f"size in GB (e.g. 24)"
            )
    if not cfg.model.path:
        raise UserError("--check-memory needs model.path (a folder with the model's config.json)")
    model = load_model_spec(cfg.model.path)
    room = f"{usable_bytes(device_bytes) / GB:.1f} GB usable of {device}'s {device_bytes / GB:.0f} GB"
    megatron = builtins.is_megatron_engine(cfg.actor.engine)
    if megatron:  # bf16 compute: Megatron's mixed precision (bf16 weights, fp32 gradients and master weights)
        precision = Precision(
            cfg.model.compute_dtype if cfg.model.compute_dtype == "bfloat16" else cfg.model.dtype,
            cfg.model.compute_dtype,
            "float32",
            "float32",
        )
    else:  # the torch engine: gradients and Adam's moments in the weights' dtype, autocast for bf16 compute
        precision = Precision(cfg.model.dtype, cfg.model.compute_dtype, cfg.model.dtype, cfg.model.dtype)
    layouts = [
        TrainLayout(
            dims,
            precision,
            cfg.actor.max_tokens_per_mb,
            recompute=cfg.actor.recompute,
            shard_optimizer=dims.distributed_optimizer,
            vocab_parallel=megatron,
            # both engines hold one chunk of float32 logits: Megatron's over its vocabulary slice (V/tp)
            logit_tokens=max(1, logits_chunk_bytes // (4 * math.ceil(model.vocab / (dims.tp if megatron else 1)))),
        )
        for dims in MixedLayout.from_config(cfg.actor.parallel, cfg.rl.trainer_processes).groups
    ]
    trainer, layout = max(
        ((train_estimate(model, layout), layout) for layout in layouts), key=lambda pair: pair[0].total
    )  # the training group whose ranks need the most
    if not trainer.fits(device_bytes):
        tokens = largest_micro_tokens(model, layout, device_bytes)
        fix = (
            f"actor.max_tokens_per_mb<={tokens} would fit"
            if tokens >= 16
            else "its weights, gradients and optimizer states alone do not fit: shard them over more ranks "
            "(actor.parallel.fsdp=true, tp, pp) or use a larger device"
        )
        raise UserError(
            f"--check-memory {device}: a trainer rank needs {trainer.describe()[len('trainer: ') :]} "
            f"but has {room}; {fix}"
        )
    tp = cfg.rollout.tp_size if cfg.rollout.backend == "sglang" else 1
    context = cfg.rollout.context_length or model.max_context  # the embedded engine's default
    server = rollout_estimate(model, tp, 1, cfg.rollout.max_running_requests, context, cfg.model.dtype)
    if not server.fits(device_bytes):
        slots = rollout_slots(model, device_bytes, tp, 1, context, cfg.model.dtype)
        fix = (
            f"rollout.max_running_requests<={slots} (or a shorter rollout.context_length) would fit"
            if slots
            else "its weights alone do not fit: raise rollout.tp_size (sglang) or use a larger device"
        )
        raise UserError(
            f"--check-memory {device}: a rollout server of {cfg.rollout.max_running_requests} sequences of "
            f"{context} tokens needs {server.describe()[len('rollout: ') :]} but has {room}; {fix}"
        )
    return f"memory check on {device}: {trainer.describe(device_bytes)}; {server.describe(device_bytes)}"


def run_simulate(args) -> int:
    import numpy as np

    from areal_hpc.sched.hardware import read_yaml
    from areal_hpc.sched.simulator import sample_lengths, simulator_for_plan

    record = read_yaml(args.plan, "plan file", "write one with `areal-hpc plan ... --out FILE`")
    if not isinstance(record, dict) or not {"workload", "train", "rollout", "predicted"} <= set(record):
        raise UserError(f"{args.plan} is not a plan (expected the YAML `areal-hpc plan --out` writes)")
    if args.staleness is not None and args.staleness < 0:
        raise UserError(f"--staleness must be 0 (synchronous) or more, got {args.staleness}")
    _positive(args.steps, "--steps", "whole number")
    sim = simulator_for_plan(record, args.staleness, not args.not_interruptible)
    w = record["workload"]
    lengths = sample_lengths(
        np.random.default_rng(args.seed),
        (args.steps + 20 + sim.staleness) * sim.batch,
        w["gen_mean"],
        w["gen_max"],
        args.spread,
    )
    result = sim.run(lengths, args.steps)
    out = {
        "plan": args.plan,
        "staleness": sim.staleness,
        "interruptible": sim.interruptible,
        "predicted_tokens_per_s": record["predicted"]["tokens_per_s"],
        "simulated_tokens_per_s": round(result.tokens_per_s, 1),
        "step_s": round(result.step_s, 3),
        "trainer_idle": round(result.trainer_idle, 3),
        "rollout_idle": round(result.rollout_idle, 3),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"simulated {args.steps} steps of {record['model']} on {record['cluster']} "
            f"(staleness {sim.staleness}, {'interruptible' if sim.interruptible else 'not interruptible'}, "
            f"answer-length spread {args.spread:g})"
        )
        print(
            f"  tokens/s: {result.tokens_per_s:,.0f} simulated vs {out['predicted_tokens_per_s']:,.0f} planned "
            f"(the planner assumes every answer has the mean length)"
        )
        print(
            f"  step: {result.step_s:,.1f} s; trainer idle {result.trainer_idle:.0%}; rollout: "
            f"{result.rollout_idle:.0%} of the sequence slots the KV cache holds left unused"
        )
    return 0


def _print_rows(rows, notes: list[str], as_json: bool, header: str) -> None:
    from areal_hpc.sched.report import table

    if as_json:
        for row in rows:
            print(json.dumps(row.to_dict()))
        return
    print(header + "\n")
    print(
        table(
            ["table", "row", "paper", "ours", "ours/paper", "role"],
            [[r.table, r.row, _fmt(r.paper, r.unit), _fmt(r.ours, r.unit), f"{r.ratio:.2f}", r.role] for r in rows],
        )
    )
    print()
    for note in notes:
        print(f"- {note}")


def _fmt(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:,.1f}" if unit == "s" else f"{value:,.0f}"


def run_repro_hex(args) -> int:
    from dataclasses import replace

    from areal_hpc.sched import repro_hex

    _positive(args.sequences, "--sequences", "whole number")
    workload = (
        repro_hex.WORKLOAD if args.sequences is None else replace(repro_hex.WORKLOAD, prompts=args.sequences, answers=1)
    )
    efficiency = repro_hex.calibrate(workload) if args.calibrate else repro_hex.CALIBRATED
    header = (
        f"AReaL-Hex (arXiv 2511.00796) vs our planner; {workload.sequences} sequences/step of "
        f"{workload.prompt_len}+{workload.gen_mean} tokens; efficiency: {repro_hex.describe(efficiency)}"
    )
    _print_rows(repro_hex.hex_rows(efficiency, workload), repro_hex.NOTES, args.json, header)
    return 0


def run_repro_eta(args) -> int:
    from areal_hpc.sched import repro_eta

    overall = repro_eta.calibrate() if args.calibrate else repro_eta.OVERALL
    header = (
        f"AReaL (arXiv 2505.24298) Table 7 vs our simulator; 1.5B on 8 H800, {repro_eta.WORKLOAD.sequences} "
        f"sequences/step, answers log-normal (mean {repro_eta.WORKLOAD.gen_mean}, cut at "
        f"{repro_eta.WORKLOAD.gen_max}); overall efficiency {overall:.3f}"
    )
    _print_rows(repro_eta.eta_rows(overall), repro_eta.NOTES, args.json, header)
    return 0
