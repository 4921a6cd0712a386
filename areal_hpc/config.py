"""Typed run configuration: one dataclass per component, merged by OmegaConf from YAML + overrides.

``load_config("configs/quickstart.yaml", ["actor.lr=1e-4"])`` returns a type-checked ``RunConfig``.
An unknown key, a value of the wrong type or a value outside what a field allows is a ``UserError``
naming the key, the value and what would be valid (the nearest key for a misspelling). Every section is
a frozen dataclass: ``areal_hpc.resolve`` decides the ``auto`` values and checks the keys against each
other, returning a new config, and nothing changes one in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_hpc import builtins
from areal_hpc.errors import UserError, closest


def spec(default: Any, help: str, *, choices=None, ge=None, gt=None, le=None, point: str | None = None):
    """A dataclass field carrying its help text and the constraints ``validate`` enforces; ``point``: the
    extension point (``builtins.POINTS``) the key names code of, a built-in's name or the user's spec."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "point": point}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls):
    return field(default_factory=cls)


@dataclass(frozen=True)
class ExperimentConfig:
    name: str = spec("quickstart", "experiment name: the folder under cluster.fileroot")
    trial: str = spec("trial0", "trial name: the folder under the experiment")
    seed: int = spec(1, "seed for data order, initialisation and sampling", ge=0)


@dataclass(frozen=True)
class ClusterConfig:
    fileroot: str = spec("runs", "root of all run outputs (a shared filesystem on a cluster)")
    device: str = spec("auto", "accelerator to use", choices=["auto", "cpu", "cuda", "npu"])
    interface: str = spec(
        "", "network interface whose address a node advertises to other nodes (e.g. ib0); empty: the node's name"
    )
    pin_cores: bool = spec(
        True,
        "local launcher: pin rollout servers and trainer ranks to disjoint CPU cores, as "
        "their devices are disjoint on a cluster (when there are at least as many cores as processes)",
    )
    fork_server: bool = spec(
        True,
        "local launcher on a machine without accelerators: start rollout servers and trainer "
        "ranks as forks of one interpreter that imported torch and transformers once, sharing those "
        "pages (~0.4 GB a process) instead of copying them",
    )


@dataclass(frozen=True)
class ModelConfig:
    path: str = spec("", "local Hugging Face model folder; empty builds a fresh model from `preset`")
    preset: str = spec("tiny", "architecture used when `path` is empty", choices=list(builtins.MODEL_PRESETS))
    dtype: str = spec("float32", "parameter dtype", choices=["float32", "bfloat16", "float16"])
    attn_impl: str = spec("sdpa", "attention implementation", choices=["sdpa", "eager", "flash_attention_2"])
    compute_dtype: str = spec(
        "float32",
        "dtype of the trainer's matrix multiplies. bfloat16: the torch engine "
        "with actor.parallel.fsdp over several replicas computes in it by FSDP2's mixed "
        "precision (bf16 gathered weights and activations, fp32 gradient reduction), else "
        "autocasts the matrix multiplies; either way the weights, gradients, optimizer state "
        "and rollout push stay in `dtype`; "
        "actor.engine=megatron trains Megatron's bf16 mixed precision (bf16 weights and "
        "rollout push, fp32 gradients, master weights and optimizer state; not with fsdp)",
        choices=["float32", "bfloat16"],
    )


@dataclass(frozen=True)
class TokenizerConfig:
    path: str = spec("", "local tokenizer folder; empty means the model's folder")


@dataclass(frozen=True)
class ArithmeticConfig:
    min_digits: int = spec(1, "fewest digits per operand", ge=1)
    max_digits: int = spec(3, "most digits per operand", ge=1, le=18)
    ops: str = spec("+", "operators to draw from, e.g. '+-*'")


@dataclass(frozen=True)
class CountdownConfig:
    num_count: int = spec(3, "how many numbers are given", ge=2, le=6)
    max_number: int = spec(20, "largest given number", ge=2)


@dataclass(frozen=True)
class DatasetConfig:
    task: str = spec(
        "arithmetic",
        "the problems trained on: a built-in task's generator, your own make_task, or "
        "custom: your data from `path` (with reward.fn)",
        point="task",
    )
    path: str = spec(
        "",
        "custom, gsm8k: your data: a JSONL, Parquet or Arrow file, a glob of them, a folder of them or "
        "a datasets.save_to_disk folder (gsm8k: empty uses the shipped sample)",
    )
    eval_path: str = spec(
        "",
        "held-out data in the same forms; empty: eval_split of a saved DatasetDict, else "
        "eval_size rows held out of `path`",
    )
    eval_split: str = spec("test", "split of a datasets.save_to_disk DatasetDict folder used for evaluation")
    prompt_field: str = spec(
        "", "column of the prompt: text (a user turn) or chat messages; empty: 'prompt', else 'messages'"
    )
    answer_field: str = spec("answer", "column the reward checks (passed to it as `answer`)")
    target_field: str = spec("", "column of a reference completion for SFT; empty: 'target' when there is one")
    max_prompt_tokens: int = spec(
        0,
        "prompts longer than this many tokens are dropped and counted; 0: the "
        "context length less generation.max_new_tokens",
        ge=0,
    )
    seed: int = spec(0, "seed of the task generator, of the train/eval split and of the row order of your data", ge=0)
    train_size: int = spec(20000, "training problems to generate (at most this many rows of your data)", ge=1)
    eval_size: int = spec(200, "held-out problems used for accuracy", ge=1)
    arithmetic: ArithmeticConfig = section(ArithmeticConfig)
    countdown: CountdownConfig = section(CountdownConfig)


@dataclass(frozen=True)
class RewardConfig:
    fn: str = spec(
        "",
        "the reward: a built-in reward or yours, called as fn(prompt, completion, prompt_ids, "
        "completion_ids, **fields) (sync or async) and returning a number or {'reward': number, "
        "metric: number}; empty: the task's own",
        point="reward",
    )
    model: str = spec(
        "",
        "a reward model trained by `areal-hpc rm` (its <run>/model folder): RL rollouts are scored by "
        "its value after the last token; evaluations keep the task's own reward (accuracy)",
    )
    timeout_s: float = spec(5.0, "seconds one reward call may take; a slower one fails (counted, scored 0)", gt=0.0)
    workers: int = spec(
        1,
        "reward worker processes; 0: score in the trainer's own process, without isolation "
        "(timeout_s is not enforced; a reward that hangs or crashes stops the run): for fast "
        "rewards you trust, such as the built-in tasks'",
        ge=0,
    )


@dataclass(frozen=True)
class DistillConfig:
    teacher_url: str = spec(
        "",
        "on-policy distillation: base URL of an SGLang-compatible server (areal-hpc serve, "
        "SGLang) holding the teacher; it scores the student's sampled tokens (no generation) and "
        "each token's advantage gains kl_weight x (teacher logprob - student logprob), minus "
        "the per-token reverse KL; empty: off",
    )
    teacher_tokenizer: str = spec(
        "",
        "the teacher's tokenizer folder, when the model_path its server reports cannot "
        "be read here; it must be the student's (logprobs of other token ids mean nothing)",
    )
    teacher_token_file: str = spec(
        "", "file holding the token the teacher's server asks for (its run's rollout_token); empty: none"
    )
    kl_weight: float = spec(1.0, "weight of the per-token distillation advantage", gt=0.0)
    reward_weight: float = spec(1.0, "weight of the task reward's advantage beside it; 0: pure distillation", ge=0.0)
    timeout_s: float = spec(300.0, "seconds the teacher may take to score one sequence", gt=0.0)


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = spec("adamw", "optimizer", choices=["adamw"])
    weight_decay: float = spec(0.01, "decoupled weight decay", ge=0.0)
    beta1: float = spec(0.9, "Adam beta1", ge=0.0, le=1.0)
    beta2: float = spec(0.999, "Adam beta2", ge=0.0, le=1.0)
    eps: float = spec(1e-8, "Adam epsilon", gt=0.0)
    lr_scheduler_type: str = spec("cosine", "learning-rate schedule", choices=["constant", "linear", "cosine"])
    warmup_steps_proportion: float = spec(0.05, "fraction of steps with linear warm-up", ge=0.0, le=1.0)
    min_lr_ratio: float = spec(0.0, "final learning rate as a fraction of the peak", ge=0.0, le=1.0)
    gradient_clipping: float = spec(1.0, "max global grad norm; 0 disables clipping", ge=0.0)


@dataclass(frozen=True)
class SFTConfig:
    lr: float = spec(2e-3, "peak learning rate of supervised fine-tuning", gt=0.0)
    total_train_steps: int = spec(300, "optimizer steps", ge=1)
    batch_size: int = spec(64, "sequences per optimizer step", ge=1)
    max_tokens_per_mb: int = spec(4096, "token budget of one packed micro-batch", ge=16)
    eval_every_steps: int = spec(100, "steps between evaluations; 0 evaluates only before and after", ge=0)
    stop_at_accuracy: float = spec(
        0.0,
        "stop once an evaluation reaches this held-out accuracy (total_train_steps "
        "caps it; needs eval_every_steps); 0: train every step",
        ge=0.0,
        le=1.0,
    )


@dataclass(frozen=True)
class PreferenceConfig:
    path: str = spec(
        "",
        "your preference pairs (areal-hpc dpo / rm): JSONL, Parquet or Arrow files (a glob or folder "
        "of them) or a datasets.save_to_disk folder, with prompt/chosen/rejected columns or "
        "chosen/rejected chat transcripts (HH-RLHF style)",
    )
    eval_path: str = spec("", "held-out pairs in the same forms; empty: eval_size pairs held out of `path`")
    prompt_field: str = spec("", "column of the prompt (text or chat messages); empty: 'prompt'")
    chosen_field: str = spec("chosen", "column of the preferred completion (text, or a whole transcript)")
    rejected_field: str = spec("rejected", "column of the other completion (text, or a whole transcript)")
    train_size: int = spec(100000, "training pairs used at most", ge=1)
    eval_size: int = spec(200, "held-out pairs (pairwise accuracy)", ge=1)
    loss: str = spec("sigmoid", "dpo: sigmoid (DPO; cDPO with label_smoothing) or ipo", choices=["sigmoid", "ipo"])
    beta: float = spec(0.1, "dpo: strength of the implicit KL constraint to the starting model", gt=0.0)
    label_smoothing: float = spec(
        0.0, "dpo (cDPO): assumed probability that a pair's labels are flipped", ge=0.0, le=0.5
    )
    nll_weight: float = spec(
        0.0,
        "weight of the chosen completions' mean token NLL added to the loss. dpo (RPO): "
        "plain DPO can lower the likelihood of both sides, and with it greedy accuracy; rm: "
        "keeps the body a language model of the chosen answers, so the reward model "
        "generalises to unseen prompts",
        ge=0.0,
    )
    lr: float = spec(1e-4, "peak learning rate", gt=0.0)
    total_train_steps: int = spec(200, "optimizer steps", ge=1)
    batch_size: int = spec(32, "pairs per optimizer step", ge=1)
    max_tokens_per_mb: int = spec(4096, "token budget of one packed micro-batch", ge=16)
    eval_every_steps: int = spec(50, "steps between held-out evaluations; 0 evaluates only before and after", ge=0)
    eval_task: bool = spec(
        False, "dpo: also evaluate the policy's greedy accuracy on the task of dataset.* at each evaluation"
    )


@dataclass(frozen=True)
class FailureBudgetConfig:
    max_consecutive: int = spec(32, "episodes failing in a row that stop the run; 0: never", ge=0)
    window: int = spec(200, "how many of the latest episodes the failure rate is measured over", ge=1)
    max_rate: float = spec(0.5, "failure rate over a full window above which the run stops; 1: never", gt=0.0, le=1.0)
    exit_code_on_failures: int = spec(
        3,
        "exit status of a run or `eval` that finished with failed episodes or rewards (0: a success; 75 and up "
        "are the launchers': 75 requeues a Slurm job, 128+N a signal)",
        ge=0,
        le=74,
    )


@dataclass(frozen=True)
class RolloutConfig:
    backend: str = spec("embedded", "rollout server backend", choices=["embedded", "sglang"])
    n_servers: int = spec(1, "rollout servers to start", ge=1)
    max_concurrent_rollouts: int = spec(64, "episodes in flight at most", ge=1)
    max_head_offpolicyness: int = spec(2, "staleness bound eta: versions a trajectory may lag", ge=0)
    consumer_batch_size: int = spec(16, "prompts per training batch", ge=1)
    host: str = spec("127.0.0.1", "address a rollout server binds (0.0.0.0 on a cluster node)")
    port: int = spec(0, "port a rollout server listens on; 0 picks a free one", ge=0, le=65535)
    cores_per_server: int = spec(
        0,
        "local launcher: CPU cores of each rollout server; 0 splits the cores evenly between servers and trainer ranks",
        ge=0,
    )
    max_running_requests: int = spec(64, "embedded engine: sequences decoded together (KV slots)", ge=1)
    context_length: int = spec(0, "embedded engine: tokens per sequence; 0 takes the model's maximum", ge=0)
    prefix_cache_mb: float = spec(
        1024.0,
        "embedded engine: memory (MiB) of keys and values kept across requests, so a prompt that starts with "
        "a sequence already run (an earlier turn, a group's prompt) prefills only the rest; least recently "
        "used evicted first, cleared at every weight update; 0 disables it",
        ge=0.0,
    )
    gather_ms: float = spec(
        0.0,
        "embedded engine: once requests finish, admission waits while their agents' next turns keep arriving "
        "within this many ms of each other (until as many wait as finished; 10 times this at most), so they "
        "join in one prefill (5 saved a few forward passes a round of multi-turn episodes, within noise: "
        "bench/results/agent_workflow_overhead.md); 0 admits each at once",
        ge=0.0,
    )
    launch_timeout_s: float = spec(300.0, "seconds a server may take to answer /health", gt=0.0)
    request_timeout_s: float = spec(600.0, "seconds one /generate call may take before it is retried", gt=0.0)
    tp_size: int = spec(1, "sglang: tensor-parallel size per server", ge=1)
    dp_size: int = spec(1, "sglang: data-parallel replicas per server", ge=1)
    mem_fraction_static: float = spec(0.8, "sglang: GPU memory fraction for weights and KV cache", gt=0.0, le=1.0)
    workflow: str = spec(
        "rlvr",
        "what one episode is: a built-in workflow or your class with `async arun_episode(engine, example)`",
        point="workflow",
    )
    workflow_args: dict = spec({}, "keyword arguments the workflow class is built with")
    turn_discount: float = spec(
        1.0,
        "multi-turn episodes: a turn's reward reaches each earlier turn multiplied by "
        "this (the episode's reward is its first turn's discounted return)",
        ge=0.0,
        le=1.0,
    )
    merge_group_requests: bool = spec(
        False,
        "groups that start together (a batch's worth after each weight update) "
        "ask for their first turns in one /generate per server, not one per group: "
        "less HTTP work on both sides, but every group then waits for the slowest "
        "sample of them all (for short answers of even length, as the quickstart's)",
    )
    failure_budget: FailureBudgetConfig = section(FailureBudgetConfig)


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = spec(0, "data-parallel size; 0 takes what the other sizes leave of the trainer processes", ge=0)
    tp: int = spec(1, "tensor-parallel size (attention heads and MLP width split over ranks)", ge=1)
    pp: int = spec(1, "pipeline-parallel size (layers split into stages)", ge=1)
    cp: int = spec(1, "context-parallel size (each sequence's tokens split over ranks)", ge=1)
    ep: int = spec(1, "expert-parallel size (MoE experts split over the data-parallel ranks); divides dp x cp", ge=1)
    sequence_parallel: bool = spec(False, "shard norms' and dropouts' activations over the tensor-parallel ranks")
    fsdp: bool = spec(
        False,
        "torch engine: shard parameters, gradients and optimizer state over the data-parallel "
        "ranks (FSDP2) instead of replicating them",
    )
    distributed_optimizer: bool = spec(
        False,
        "actor.engine=megatron: shard the optimizer state (fp32 master weights "
        "and Adam moments) over the data-parallel ranks (ZeRO-1, Megatron's "
        "distributed optimizer); not with fsdp",
    )
    vpp: int = spec(
        1,
        "actor.engine=megatron: virtual pipeline stages per pipeline rank (interleaved 1F1B); "
        "needs pp > 1, and pp x vpp must divide the layers",
        ge=1,
    )
    allocation: str = spec(
        "", "the planner's training allocation, e.g. megatron:d8p1t1 (sets dp, pp and tp; `areal-hpc plan` prints it)"
    )
    groups: list = spec(
        [],
        "training groups of different shapes, each its own mesh, in rank order: [[dp, tp, pp], "
        "...], e.g. [[2, 1, 1], [1, 2, 1]] (submit --plan writes it when the plan's training "
        "groups differ; torch engine); empty: one mesh as dp, tp, pp say",
    )
    dp_weights: list = spec(
        [],
        "each data-parallel replica's relative share of every batch, e.g. [3, 1] (submit "
        "--plan sets them from the planner's speed of each group's devices); empty: equal",
    )


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = spec(
        0,
        "LoRA rank r of the actor's adapters (peft, torch engine, one process or dp/fsdp ranks): "
        "only the adapters train, checkpoints hold only them, rollout servers get the merged weights; "
        "0: full fine-tuning",
        ge=0,
    )
    alpha: float = spec(16.0, "LoRA scale numerator: the update B·A is scaled by alpha / rank", gt=0.0)
    dropout: float = spec(0.0, "dropout on the adapters' input while training", ge=0.0, le=1.0)
    target_modules: list = spec(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "names of the decoder's linear layers that get adapters (attention and MLP projections of a Qwen2-style model)",
    )


@dataclass(frozen=True)
class ActorConfig:
    lr: float = spec(1e-4, "peak learning rate of the RL actor", gt=0.0)
    adv_estimator: str = spec(
        "grpo", "advantage estimator (ppo trains a critic and uses GAE)", point="advantage_estimator"
    )
    aggregation: str = spec(
        "token-mean",
        "how token losses make the batch loss (Dr.GRPO: seq-mean-token-sum-norm)",
        choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
    )
    eps_clip: float = spec(0.2, "PPO clip range", gt=0.0)
    eps_clip_high: float = spec(0.0, "upper clip range (DAPO clip-higher); 0 means eps_clip", ge=0.0)
    importance_level: str = spec(
        "token", "importance ratio per token (PPO) or per sequence (GSPO)", choices=["token", "sequence"]
    )
    decoupled_loss: bool = spec(
        True,
        "decoupled PPO (AReaL): the ratio and its clip against the policy before this "
        "step (π_prox), the behaviour weight π_prox/π_behav beside them; false: PPO's own, "
        "the ratio and clip against the policy that sampled each token",
    )
    behav_correction: str = spec(
        "cap",
        "decoupled PPO: cap the behaviour weight, mask tokens beyond the cap, mask by the KPop criterion, or none",
        choices=["cap", "mask", "kpop", "none"],
    )
    behav_imp_weight_cap: float = spec(5.0, "cap of the behaviour importance weight (decoupled PPO)", gt=0.0)
    kpop_threshold: float = spec(2.0, "KPop: mask tokens whose binary KL (either direction) exceeds this", gt=0.0)
    policy_loss: str = spec(
        "ppo",
        "policy objective: ppo (clipped ratio), sapo (soft sigmoid gate instead of the "
        "clip) or m2po (unclipped, tokens masked until the batch's second moment of "
        "log π/π_behav is within m2_threshold: made for very stale data), or your own",
        point="policy_loss",
    )
    sapo_tau_pos: float = spec(1.0, "sapo: gate temperature for positive advantages", gt=0.0)
    sapo_tau_neg: float = spec(1.05, "sapo: gate temperature for negative advantages", gt=0.0)
    m2_threshold: float = spec(0.04, "m2po: bound on the mean squared log importance ratio of the kept tokens", gt=0.0)
    ppo_n_minibatches: int = spec(1, "PPO minibatches per training step", ge=1)
    kl_coef: float = spec(0.0, "KL penalty coefficient to the reference model (the starting weights)", ge=0.0)
    max_tokens_per_mb: int = spec(4096, "token budget of one packed micro-batch", ge=16)
    recompute: str = spec(
        "none",
        "activation recomputation in the backward pass, trading compute for memory: none, "
        "selective (each layer's core attention recomputed; the torch engine: its whole attention "
        "block) or full (each layer's whole forward recomputed from its input)",
        choices=["none", "selective", "full"],
    )
    tree_training: str = spec(
        "off",
        "AReaL-DTA tree training: dta trains each batch's prefix tree depth first (a "
        "shared prefix, such as a GRPO group's prompt, computed once; exact gradients; the torch "
        "engine, one process or data-parallel replicas, token-level losses) instead of packed "
        "micro-batches; auto: dta where this run's layout allows it (the torch engine, a "
        "token-level loss, no LoRA, no activation recomputation, data parallelism only), else off",
        choices=["off", "dta", "auto"],
    )
    tree_min_saved_tokens: int = spec(
        64,
        "tree training: a shared prefix is its own node (one more forward and "
        "backward of the model) only where sharing it saves this many token "
        "computations (its length x (branches - 1)); shorter ones are recomputed in "
        "each branch; 0: every common prefix is shared",
        ge=0,
    )
    tree_cost: list = spec(
        [0.0, 1.0, 0.0, 0.0, 0.0],
        "tree training over dp replicas: the cost model that cuts each "
        "minibatch's tree into equal parts, coefficients of [leaves, tokens, fork tokens, prefix "
        "tokens, levels]; 'areal-hpc tree-cost RUN_DIR' fits them from a run",
    )
    dynamic_sampling: bool = spec(False, "DAPO: drop groups whose rewards are all equal (they carry no signal)")
    overlong_cache_tokens: int = spec(0, "DAPO overlong penalty: length band before max_new_tokens; 0 disables", ge=0)
    overlong_penalty: float = spec(1.0, "DAPO overlong penalty at max_new_tokens", ge=0.0)
    gamma: float = spec(1.0, "ppo: discount", ge=0.0, le=1.0)
    lam: float = spec(1.0, "ppo: GAE lambda", ge=0.0, le=1.0)
    critic_lr: float = spec(1e-4, "ppo: peak learning rate of the critic", gt=0.0)
    value_clip: float = spec(0.2, "ppo: value clip range", gt=0.0)
    engine: str = spec(
        "torch",
        "training engine: torch (PyTorch-native: FSDP2 or replicated dp, DTensor TP), "
        "megatron (Megatron-core GPTModel: dp, tp, pp; extra `megatron`) or your own",
        point="train_engine",
    )
    parallel: ParallelConfig = section(ParallelConfig)
    lora: LoRAConfig = section(LoRAConfig)


@dataclass(frozen=True)
class RLConfig:
    total_train_steps: int = spec(100, "policy updates (each one batch of rollout.consumer_batch_size groups)", ge=1)
    eval_every_steps: int = spec(20, "steps between held-out evaluations; 0 evaluates only before and after", ge=0)
    sft_warmup_steps: int = spec(0, "SFT steps (with the sft section's settings) before RL starts", ge=0)
    sft_warmup_path: str = spec(
        "",
        "the SFT warm-up's demonstrations, in the forms of dataset.path, when they are not the RL prompts; "
        "empty: dataset.path",
    )
    weight_sync: str = spec("disk", "how new weights reach the rollout servers", choices=["disk", "distributed"])
    rank0_training: str = spec(
        "auto",
        "where trainer rank 0 trains: child (a process of its own, apart from rank 0's "
        "rollout side: controller, HTTP, rewards, shard commits, evaluations; the two then do "
        "not share one interpreter lock; needs rl.weight_sync=disk), thread (a thread of rank "
        "0's process), or auto (child with the disk sync on a CPU; a thread on an accelerator)",
        choices=["auto", "child", "thread"],
    )
    weight_sync_bucket_mb: int = spec(64, "distributed weight sync: megabytes per broadcast bucket", ge=1)
    interruptible: bool = spec(True, "a weight update interrupts generation (False: wait for episodes to finish)")
    trainer_processes: int = spec(
        1, "trainer processes (ranks of actor.parallel's mesh; gloo on CPU, NCCL on GPU)", ge=1
    )
    proxy_records_per_step: int = spec(
        0,
        "records of the login-node proxy's sessions (rewarded, eligible, at most "
        "rollout.max_head_offpolicyness versions stale) added to each training batch at "
        "most; 0: the proxy's records are not trained on",
        ge=0,
    )
    proxy_tenant: str = spec("", "train only on this tenant's proxy records; empty: every tenant's")


@dataclass(frozen=True)
class GenerationConfig:
    n_samples: int = spec(8, "samples per prompt (the GRPO group size)", ge=1)
    max_new_tokens: int = spec(16, "generated tokens at most", ge=1)
    temperature: float = spec(1.0, "sampling temperature", gt=0.0)
    top_p: float = spec(1.0, "nucleus sampling mass", gt=0.0, le=1.0)
    top_k: int = spec(-1, "top-k sampling; -1 disables", ge=-1)
    greedy: bool = spec(False, "greedy decoding instead of sampling")


@dataclass(frozen=True)
class SaverConfig:
    freq_steps: int = spec(
        50, "steps between checkpoints (a preempted job also saves when signalled); 0 saves only the final model", ge=0
    )


@dataclass(frozen=True)
class SlurmTrainerConfig:
    partition: str = spec("train", "partition of the trainer ranks (het component 0)")
    nodes: int = spec(1, "nodes of the trainer component; rl.trainer_processes are spread evenly over them", ge=1)
    gpus_per_node: int = spec(0, "accelerators (GRES slurm.gres) per trainer node; one per rank when > 0", ge=0)
    cpus_per_task: int = spec(1, "CPU cores per trainer rank (its torch threads)", ge=1)
    mem: str = spec("", "memory per trainer node, e.g. 64G; empty: the partition's default")


@dataclass(frozen=True)
class SlurmRolloutConfig:
    partition: str = spec("rollout", "partition of the rollout servers (het components 1..k)")
    servers_per_node: int = spec(1, "rollout servers per node; rollout.n_servers fixes the node count", ge=1)
    gpus_per_server: int = spec(0, "accelerators per rollout server (its tensor-parallel size for SGLang)", ge=0)
    cpus_per_server: int = spec(1, "CPU cores per rollout server", ge=1)
    mem: str = spec("", "memory per rollout node, e.g. 64G; empty: the partition's default")


@dataclass(frozen=True)
class SlurmConfig:
    account: str = spec("", "account charged (sbatch --account); empty: your default")
    qos: str = spec("", "quality of service (sbatch --qos); empty: the partition's default")
    time: str = spec("01:00:00", "wall time of each incarnation of the job (sbatch --time), e.g. 2-00:00:00")
    signal_lead_s: int = spec(
        120,
        "seconds before the time limit (or preemption) the trainer is told to save and the job requeues itself",
        ge=0,
    )
    max_requeues: int = spec(10, "how many times the job may requeue itself after a time-out or preemption", ge=0)
    gres: str = spec("gpu", "GRES name of the accelerators (gpu; npu on Ascend sites)")
    mpi: str = spec("", "srun --mpi plugin for the job's step (pmix where MPI is used); empty: the site default")
    extra_sbatch: list = spec([], "extra '#SBATCH' lines for every component, e.g. ['--exclusive']")
    task_groups: list = spec(
        [],
        "the job's tasks in global-rank order, each [role, tasks, accelerators per task, "
        "tensor-parallel size], role trainer or rollout (submit --plan writes it); empty: "
        "rl.trainer_processes trainer ranks, then rollout.n_servers servers",
    )
    trainer: SlurmTrainerConfig = section(SlurmTrainerConfig)
    rollout: SlurmRolloutConfig = section(SlurmRolloutConfig)


@dataclass(frozen=True)
class StatsConfig:
    tensorboard: bool = spec(True, "write TensorBoard event files")
    plot: bool = spec(True, "write PNG curves at the end of a run")


@dataclass(frozen=True)
class ProxyConfig:
    host: str = spec("127.0.0.1", "address the login-node proxy binds (0.0.0.0 to serve agents on other hosts)")
    port: int = spec(8080, "port the proxy listens on; 0 picks a free one", ge=0, le=65535)
    backends: str = spec(
        "",
        "rollout servers as host:port, comma-separated; empty: those the run's name-resolve "
        "lists (rollout/servers), with heartbeats",
    )
    name_resolve: str = spec("", "name-resolve folder to find rollout servers in; empty: <run folder>/name_resolve")
    keys_file: str = spec("", "YAML of tenants and their hashed keys (`areal-hpc proxy-key` writes it)")
    rollout_token_file: str = spec(
        "",
        "the run's rollout token (0600 file) sent to the rollout servers; empty: "
        "<run folder>/rollout_token when it exists",
    )
    shards_dir: str = spec("", "folder of the proxy's trajectory shards; empty: <run folder>/shards")
    model_name: str = spec("", "model id agents name (/v1/models); empty: the model folder's name")
    requests_per_minute: float = spec(600.0, "default per-tenant completion requests per minute; 0: unlimited", ge=0.0)
    tokens_per_minute: float = spec(
        1e6, "default per-tenant prompt + completion tokens per minute; 0: unlimited", ge=0.0
    )
    max_request_bytes: int = spec(1 << 20, "largest request body; larger is refused with 413", ge=1024)
    default_max_tokens: int = spec(256, "reply length when a request gives no max_tokens", ge=1)
    max_tokens_cap: int = spec(4096, "largest max_tokens a request may ask for", ge=1)
    discount: float = spec(
        1.0, "factor by which a turn's reward reaches each earlier turn of its conversation", ge=0.0, le=1.0
    )
    reward_grace_s: float = spec(300.0, "seconds after end_session that rewards are still taken (late rewards)", ge=0.0)
    session_idle_s: float = spec(3600.0, "a session without a request this long is ended and written", gt=0.0)
    request_timeout_s: float = spec(600.0, "seconds one /generate call may take before it is retried elsewhere", gt=0.0)


@dataclass(frozen=True)
class RunConfig:
    experiment: ExperimentConfig = section(ExperimentConfig)
    cluster: ClusterConfig = section(ClusterConfig)
    model: ModelConfig = section(ModelConfig)
    tokenizer: TokenizerConfig = section(TokenizerConfig)
    dataset: DatasetConfig = section(DatasetConfig)
    reward: RewardConfig = section(RewardConfig)
    distill: DistillConfig = section(DistillConfig)
    optimizer: OptimizerConfig = section(OptimizerConfig)
    sft: SFTConfig = section(SFTConfig)
    preference: PreferenceConfig = section(PreferenceConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    actor: ActorConfig = section(ActorConfig)
    rl: RLConfig = section(RLConfig)
    generation: GenerationConfig = section(GenerationConfig)
    saver: SaverConfig = section(SaverConfig)
    stats: StatsConfig = section(StatsConfig)
    slurm: SlurmConfig = section(SlurmConfig)
    proxy: ProxyConfig = section(ProxyConfig)

    @property
    def run_dir(self) -> Path:
        """Where everything this run writes lives: <fileroot>/<experiment>/<trial>/."""
        return Path(self.cluster.fileroot) / self.experiment.name / self.experiment.trial


def _walk(cls, prefix: str = ""):
    """Yield (dotted path, type, is_section) for every field of a config dataclass, depth first."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, kind = prefix + f.name, hints[f.name]
        is_section = dataclasses.is_dataclass(kind)
        yield path, kind, is_section
        if is_section:
            yield from _walk(kind, path + ".")


LEAF_TYPES = {path: kind for path, kind, is_section in _walk(RunConfig) if not is_section}
SECTIONS = {path for path, _, is_section in _walk(RunConfig) if is_section}


# AReaL's names for keys this project names otherwise. Accepted in YAML and on the command line and read as
# the current key, so a config written for AReaL keeps working; docs/reference/config.md lists them.
LEGACY_KEYS = {"gconfig": "generation", "actor.kl_ctl": "actor.kl_coef"}


def current_name(path: str) -> str:
    """The current name of a dotted key that may start with a legacy one: gconfig.top_p -> generation.top_p."""
    for old, new in LEGACY_KEYS.items():
        if path == old or path.startswith(old + "."):
            return new + path[len(old) :]
    return path


def _unknown_key(key: str, where: str) -> UserError:
    return UserError(f"unknown config key '{key}' {where}{closest(key, [*LEAF_TYPES, *SECTIONS])}")


def _not_a_section_value(key: str, where: str) -> UserError:
    example = next(p for p in LEAF_TYPES if p.startswith(key + "."))
    return UserError(f"config key '{key}' {where} is a section, not a value; set its keys, e.g. {example}=...")


def _with_current_names(tree: dict, where: str, prefix: str = "") -> dict:
    """``tree`` with its legacy keys renamed (each alias renames a key within its own section)."""
    renamed: dict = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        name = current_name(path).rpartition(".")[2]
        if name in renamed or (name != key and name in tree):
            raise UserError(f"config keys '{path}' and '{prefix}{name}' {where} name one key; keep '{prefix}{name}'")
        renamed[name] = _with_current_names(value, where, f"{prefix}{name}.") if isinstance(value, dict) else value
    return renamed


def _check_keys(tree: dict, where: str, prefix: str = "") -> None:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if path in SECTIONS:
            if not isinstance(value, dict):
                raise _not_a_section_value(path, where)
            _check_keys(value, where, path + ".")
        elif path not in LEAF_TYPES:
            raise _unknown_key(path, where)


class ConfigLoader(yaml.SafeLoader):
    """YAML 1.1 without sexagesimal numbers: ``time: 4:00:00`` stays the text a Slurm time limit is,
    not the integer 14400."""


def _without_sexagesimal(regexp: re.Pattern) -> re.Pattern:
    lines = [line for line in regexp.pattern.split("\n") if "(?::[0-5]?[0-9])+" not in line]
    return re.compile("\n".join(lines).rstrip() + ("" if lines[-1].endswith(")$") else ")$"), regexp.flags)


ConfigLoader.yaml_implicit_resolvers = {
    first: [
        (tag, _without_sexagesimal(regexp) if tag.endswith((":int", ":float")) else regexp) for tag, regexp in resolvers
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _read_yaml(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        tree = yaml.load(file.read_text(), Loader=ConfigLoader) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise UserError(f"config file {path} must hold a mapping of sections, got {type(tree).__name__}")
    tree = _with_current_names(tree, f"in {path}")
    _check_keys(tree, f"in {path}")
    return tree


def _parse_overrides(overrides: list[str]) -> list[str]:
    """The overrides checked, each legacy key under its current name."""
    parsed = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"override '{item}' is not of the form key=value (e.g. actor.lr=1e-4)")
        key = current_name(key)
        if key in SECTIONS:
            raise _not_a_section_value(key, "on the command line")
        if key not in LEAF_TYPES and not in_mapping(key):
            raise _unknown_key(key, "on the command line")
        parsed.append(f"{key}={value}")
    return parsed


def in_mapping(key: str) -> bool:
    """Whether ``key`` names an entry of a mapping-valued key (``rollout.workflow_args.max_turns``)."""
    parts = key.split(".")
    return any(LEAF_TYPES.get(".".join(parts[:n])) is dict for n in range(1, len(parts)))


def _override_layer(overrides: list[str]):
    """``key=value`` items as a config layer. Values of text fields stay exactly as typed: parsed as
    YAML, a trial named ``04718e80`` or ``1e3`` would become a float and then the text ``4.718e+83``.
    (A mapping's entries are parsed as YAML, as they would be in the file.)"""
    pairs = [item.partition("=")[::2] for item in overrides]
    layer = OmegaConf.from_dotlist([f"{k}={v}" for k, v in pairs if LEAF_TYPES.get(k) is not str])
    for key, value in pairs:
        if LEAF_TYPES.get(key) is str:
            OmegaConf.update(layer, key, value, force_add=True)
    return layer


def _type_error(exc: OmegaConfBaseException) -> UserError:
    key = getattr(exc, "full_key", "") or "?"
    expected = LEAF_TYPES[key].__name__ if key in LEAF_TYPES else "a valid value"
    value = str(exc).splitlines()[0]
    return UserError(f"config key '{key}': {value} (expected {expected})")


def validate(cfg, prefix: str = "") -> None:
    """Check every field against the choices and bounds declared with ``spec``."""
    for f in dataclasses.fields(cfg):
        value, path = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            validate(value, path + ".")
            continue
        meta = f.metadata
        if meta.get("point"):
            builtins.check(meta["point"], value)
        if meta.get("choices") and value not in meta["choices"]:
            allowed = ", ".join(map(str, meta["choices"]))
            raise UserError(f"config key '{path}': {value!r} is not one of {allowed}")
        for bound, holds, word in (("ge", operator.ge, ">="), ("gt", operator.gt, ">"), ("le", operator.le, "<=")):
            if meta.get(bound) is not None and not holds(value, meta[bound]):
                raise UserError(f"config key '{path}': {value!r} must be {word} {meta[bound]}")


def load_config(path: str | list[str] | None = None, overrides: list[str] = ()) -> RunConfig:
    """Merge defaults <- YAML file(s) (a site profile, then the experiment) <- ``key=value`` overrides
    into a RunConfig, each key checked on its own (``resolve`` checks them against each other)."""
    layers = [OmegaConf.structured(RunConfig)]
    for file in [path] if isinstance(path, str) else path or []:
        layers.append(OmegaConf.create(_read_yaml(file)))
    if overrides:
        layers.append(_override_layer(_parse_overrides(list(overrides))))
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(*layers))
    except OmegaConfBaseException as exc:
        raise _type_error(exc) from None
    validate(cfg)
    return cfg


PATH_KEYS = ("cluster.fileroot", "model.path", "tokenizer.path", "dataset.path", "dataset.eval_path")
SPEC_KEYS = tuple(point.key for point in builtins.POINTS.values())  # may be 'path/to/file.py:name' specs


def absolute_path_overrides(cfg: RunConfig) -> list[str]:
    """``key=/absolute/path`` for every relative path the config sets (resolved from this folder): a
    Slurm job runs on other nodes and from another folder than the one it was submitted from."""
    overrides = []
    for key in PATH_KEYS + SPEC_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        path, sep, attr = value.rpartition(":") if key in SPEC_KEYS else (value, "", "")
        if key in SPEC_KEYS and not path.endswith(".py"):
            continue
        if path and not Path(path).is_absolute():
            overrides.append(f"{key}={Path(path).resolve()}{sep}{attr}")
    return overrides


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_resolved(cfg: RunConfig) -> Path:
    """Write the resolved config next to the run's outputs, so every run says how it was made."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    out = cfg.run_dir / "config.yaml"
    out.write_text(to_yaml(cfg))
    return out


def run_config_show(args: argparse.Namespace) -> int:
    """``areal-hpc config show``: the merged config (defaults <- YAML <- overrides) as YAML on stdout."""
    print(to_yaml(load_config(args.config, args.overrides)), end="")
    return 0
