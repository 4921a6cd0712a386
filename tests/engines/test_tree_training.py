"""Tree training (``engines.torch.tree``, ``actor.tree_training=dta``) is exact: on random prefix trees
(depth, fan-out, sequences that are prefixes of others, duplicates, one-token segments and sequences),
the per-token logprobs and entropies, the loss and every parameter's gradient equal those of the flat
engine and of Hugging Face's own forward of each sequence alone, within float32 tolerance
(``RTOL``: relative to the largest magnitude of each tensor, with a floor where a gradient vanishes
exactly); through ``PPOActor``'s decoupled PPO
loss on GRPO groups sharing a prompt, and for a critic's value loss; and over two data-parallel replicas
(replicate and FSDP2 on gloo) through the trainer's own path, against the flat engine in one process."""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import itertools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hpc.agents.engine import EpisodeContext, EpisodeSettings, Sampling, Scorer
from areal_hpc.agents.groups import run_episode
from areal_hpc.agents.search.corpus import build_world
from areal_hpc.agents.search.workflow import SearchAgentWorkflow
from areal_hpc.algo.packing import pack
from areal_hpc.algo.ppo import decoupled_ppo_loss, token_weights, value_loss
from areal_hpc.algo.prefix_tree import build_prefix_tree
from areal_hpc.config import ActorConfig, OptimizerConfig, load_config
from areal_hpc.data.rewards import RewardPool
from areal_hpc.data.trajectory import Reward, Trajectory
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.engines.torch import tree as tree_module
from areal_hpc.engines.torch.engine import TorchTrainEngine
from areal_hpc.engines.torch.outputs import PolicyOutputs, ValueOutputs
from areal_hpc.engines.torch.tree import Segments, cache_keyword, check_tree_layout, is_chain
from areal_hpc.errors import UserError
from areal_hpc.layout import ParallelDims
from areal_hpc.models.hf import load_critic, load_model, load_tokenizer
from areal_hpc.resolve import Host, resolve
from areal_hpc.train.actor import PPOActor
from areal_hpc.train.build import build_actor
from areal_hpc.train.trajectory_batch import build_batch, split_minibatches
from tests.agents.test_search import REWARD_FN as SEARCH_REWARD
from tests.agents.test_search import example_of
from tests.agents.test_workflows import InProcessModel
from tests.algo.test_prefix_tree import shared_prefix_batches
from tests.engines.test_parallel_layouts import STEP, assert_same_step
from tests.trainer_processes import run_ranks

RTOL = 1e-5  # float32: |tree − reference| ≤ RTOL · max |reference| per tensor
FLOOR = 1e-7  # ... + FLOOR · the largest gradient entry of the model (rounding noise where one is exactly 0)
TEMPERATURE = 0.9  # the engine's, for batches without per-position temperatures


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_model(tiny_model_dir)


def engine(
    model: torch.nn.Module,
    tree_training: str,
    forward_fn=None,
    max_tokens: int = 24,
    compute_dtype: str = "float32",
    min_saved_tokens: int = 0,
) -> TorchTrainEngine:
    """An engine on a copy of ``model``; the flat one cuts its batches into several micro-batches."""
    return TorchTrainEngine(
        copy.deepcopy(model),
        forward_fn or PolicyOutputs(TEMPERATURE),
        lr=1e-3,
        optimizer=OptimizerConfig(gradient_clipping=0.0),
        max_tokens_per_mb=max_tokens,
        tree_training=tree_training,
        compute_dtype=compute_dtype,
        tree_min_saved_tokens=min_saved_tokens,
    )


def ppo_batch(sequences: list[list[int]], seed: int, per_position_temperatures: bool) -> SequenceBatch:
    """Random loss masks, behaviour logprobs and advantages; token-mean weights over the batch; each
    position's temperature (where asked) and ``where`` = 1000·sequence + position, to find each output."""
    generator = torch.Generator().manual_seed(seed)
    masks = [(torch.rand(len(s), generator=generator) < 0.7).int().tolist() for s in sequences]
    temperatures = [0.5 + torch.rand(len(s), generator=generator) for s in sequences]
    batch = SequenceBatch(
        sequences,
        masks,
        {
            "behav_logprobs": [-5.0 + 0.3 * torch.randn(len(s), generator=generator) for s in sequences],
            "advantages": [torch.randn(len(s), generator=generator) for s in sequences],
            "where": [1000 * i + torch.arange(len(s)) for i, s in enumerate(sequences)],
        },
        temperatures if per_position_temperatures else None,
    )
    packed, _ = batch.packed()
    batch.set_packed(
        "weights",
        token_weights(packed.target_mask, packed.cu_seqlens, "token-mean", packed.n_targets, len(sequences), 0),
    )
    return batch


def recording(loss_fn, seen: dict):
    """``loss_fn``, noting (logprob, entropy) of every target by its ``where``."""

    def loss(outputs, packed, fields):
        for where, logprob, entropy in zip(
            fields["where"][packed.target_mask].tolist(),
            outputs["logprobs"][packed.target_mask].tolist(),
            outputs["entropy"][packed.target_mask].tolist(),
        ):
            seen[where] = (logprob, entropy)
        return loss_fn(outputs, packed, fields)

    return loss


def each_sequence_alone(model, batch: SequenceBatch, cfg) -> tuple[torch.Tensor, dict]:
    """The decoupled PPO loss from Hugging Face's forward of each sequence by itself (backward run),
    and (logprob, entropy) of every target by its ``where``."""
    loss, seen = torch.zeros(()), {}
    for i, tokens in enumerate(batch.sequences):
        packed = pack([tokens], [batch.loss_masks[i]])
        temperatures = (
            batch.temperatures[i] if batch.temperatures is not None else torch.full((len(tokens),), TEMPERATURE)
        )
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float() / temperatures[:, None]
        log_p = logits.log_softmax(-1)
        logprobs = torch.cat([log_p[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0], torch.zeros(1)])
        entropy = -(log_p.exp() * log_p).sum(-1)
        f = {name: values[i] for name, values in batch.fields.items()}
        part, _ = decoupled_ppo_loss(
            logprobs,
            logprobs.detach(),
            f["behav_logprobs"],
            f["advantages"],
            packed.target_mask,
            packed.cu_seqlens,
            f["weights"],
            cfg,
        )
        loss = loss + part
        for t in packed.target_mask.nonzero()[:, 0].tolist():
            seen[1000 * i + t] = (logprobs[t].item(), entropy[t].item())
    loss.backward()
    return loss.detach(), seen


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| over max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def assert_same_gradients(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    theirs = {name: p.grad for name, p in reference.named_parameters()}
    largest = max(float(g.abs().max()) for g in theirs.values())
    for name, p in model.named_parameters():
        tolerance = RTOL * float(theirs[name].abs().max()) + FLOOR * largest
        assert float((p.grad - theirs[name]).abs().max()) <= tolerance, name


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shared_prefix_batches(),
    st.integers(0, 2**16),
    st.booleans(),
    st.sampled_from([0, 0, 3, 8]),
    st.sampled_from([5, 10, 24]),
)
def test_tree_step_equals_the_flat_step_and_each_sequence_alone(
    policy, sequences, seed, per_position_temperatures, min_saved_tokens, max_tokens
):
    """With every common prefix shared (0), or only those saving 3 or 8 token computations; with rows of
    at most 24 tokens (most trees forwarded whole, each under its tree mask), or of 5 and 10 (the larger
    trees a level at a time)."""
    sequences = [[3 + 41 * token for token in s] for s in sequences]
    assert_tree_step_exact(policy, ppo_batch(sequences, seed, per_position_temperatures), max_tokens, min_saved_tokens)


def test_a_branching_subtree_is_flattened_under_the_prefix_above_it(policy, monkeypatch):
    """Subtrees of at most 8 tokens flattened: two prompts (30 and 27 tokens, runs of their own) whose
    answers branch after shared tokens; every answer subtree is one row under its tree mask, all in one
    chunk, each reading its own prompt's keys and values (padded to the longest)."""
    monkeypatch.setattr(tree_module, "FLAT_SUBTREE_TOKENS", 8)
    prompts = [list(range(3, 33)), list(range(40, 67))]
    answers = [[100, 101, 102], [100, 101, 103], [100, 104], [105, 106, 107, 108], [105, 106]]
    sequences = [prompt + answer for prompt in prompts for answer in answers]
    tree = build_prefix_tree(sequences)
    segments = Segments(tree, 8)
    below = [segments.of(child) for root in tree.roots for child in tree.nodes[root].children]
    assert [len(segments.of(root)) for root in tree.roots] == [1, 1]  # the prompts: runs
    assert sum(not is_chain(tree, segment) for segment in below) == 2  # a branching subtree per prompt
    assert_tree_step_exact(policy, ppo_batch(sequences, 0, True), max_tokens=4096, min_saved_tokens=0)


def assert_tree_step_exact(policy, batch: SequenceBatch, max_tokens: int, min_saved_tokens: int) -> None:
    """The tree engine's PPO step on ``batch`` has the flat engine's and each sequence's own logprobs,
    entropies, loss, token counts and gradients."""
    tree = engine(policy, "dta", max_tokens=max_tokens, min_saved_tokens=min_saved_tokens)
    flat = engine(policy, "off")
    tree_actor, flat_actor = PPOActor(tree, ActorConfig()), PPOActor(flat, ActorConfig())
    tree_seen, flat_seen = {}, {}
    tree_stats = tree.train_step(batch, recording(tree_actor._policy_loss, tree_seen))
    flat_stats = flat.train_step(batch, recording(flat_actor._policy_loss, flat_seen))
    reference = copy.deepcopy(policy)
    reference_loss, reference_seen = each_sequence_alone(reference, batch, tree_actor.loss_cfg)

    assert tree_seen.keys() == flat_seen.keys() == reference_seen.keys()
    for seen in (tree_seen, flat_seen):
        got, want = torch.tensor([seen[k] for k in reference_seen]), torch.tensor(list(reference_seen.values()))
        if len(want):
            assert relative_difference(got, want) <= RTOL
    # the loss is a sum of terms of either sign: its rounding is relative to their size, not to the sum
    terms = sum(float((w * a).abs().sum()) for w, a in zip(batch.fields["weights"], batch.fields["advantages"]))
    assert tree_stats["loss"] == pytest.approx(reference_loss.item(), rel=RTOL, abs=RTOL * terms + 1e-7)
    assert tree_stats["loss"] == pytest.approx(flat_stats["loss"], rel=RTOL, abs=RTOL * terms + 1e-7)
    for key in ("loss_tokens", "kept_tokens", "capped_tokens"):
        assert tree_stats.get(key, 0.0) == flat_stats.get(key, 0.0)
    if reference_seen:  # some target: every parameter has a gradient
        assert_same_gradients(tree.model, reference)
        assert_same_gradients(flat.model, reference)


def grpo_groups(groups: int = 2, samples: int = 4, prompts: tuple[int, ...] = (12, 7), seed: int = 0) -> SequenceBatch:
    """GRPO groups of ``samples`` completions sharing a prompt, one completion a prefix of another and one
    a duplicate (as sampling at low temperature gives), with group-normalised advantages."""
    generator = torch.Generator().manual_seed(seed)
    sequences, masks, advantages = [], [], []
    for g in range(groups):
        prompt = prompts[g % len(prompts)]
        shared = torch.randint(3, 600, (prompt,), generator=generator).tolist()
        completions = [
            torch.randint(3, 600, (int(n),), generator=generator).tolist()
            for n in torch.randint(1, 10, (samples - 2,), generator=generator)
        ]
        completions += [completions[0][:1], completions[1]]
        rewards = torch.rand(samples, generator=generator)
        for completion, advantage in zip(completions, (rewards - rewards.mean()) / (rewards.std() + 1e-6)):
            sequences.append(shared + completion)
            masks.append([0] * prompt + [1] * len(completion))
            advantages.append(torch.full((prompt + len(completion),), float(advantage)))
    behaviour = [-5.0 + 0.3 * torch.randn(len(s), generator=generator) for s in sequences]
    batch = SequenceBatch(sequences, masks, {"advantages": advantages, "behav_logprobs": behaviour})
    packed, _ = batch.packed()
    batch.set_packed(
        "weights",
        token_weights(
            packed.target_mask, packed.cu_seqlens, "seq-mean-token-mean", packed.n_targets, len(sequences), 0
        ),
    )
    return batch


@pytest.mark.parametrize(
    "max_tokens, min_saved_tokens, flat_subtree_tokens",
    [(24, 0, 512), (4096, 0, 0), (4096, 16, 0), (4096, 16, 512)],
    ids=["chunk_per_group", "groups_in_one_chunk", "short_prefixes_recomputed", "groups_flattened"],
)
def test_ppo_actor_update_on_grpo_groups_equals_flat(
    policy, monkeypatch, max_tokens, min_saved_tokens, flat_subtree_tokens
):
    """Prompts of 30, 10 and 3 tokens, a level at a time (no subtree flattened): with room, the prompts
    run in two chunks of one wave (the 3-token one would make padding most of the first) and all
    completions in one chunk, each row over its own prompt's K/V, read from either chunk and padded to
    the longest. Sharing only what saves 16 token computations, the 3-token prompt and the one-token
    completion prefix are recomputed per branch. With 24-token rows, each group a level at a time,
    its small answer subtrees flattened; with 512, every group one row, all shared."""
    monkeypatch.setattr(tree_module, "FLAT_SUBTREE_TOKENS", flat_subtree_tokens)
    batch = grpo_groups(groups=3, prompts=(30, 10, 3))
    assert build_prefix_tree(batch.sequences).compression > 1.8
    tree, flat = engine(policy, "dta", max_tokens=max_tokens, min_saved_tokens=min_saved_tokens), engine(policy, "off")
    tree_stats = PPOActor(tree, ActorConfig()).update([batch])
    flat_stats = PPOActor(flat, ActorConfig()).update([batch])
    assert tree_stats["actor/loss"] == pytest.approx(flat_stats["actor/loss"], rel=RTOL)
    assert tree_stats["actor/entropy_sum"] == pytest.approx(flat_stats["actor/entropy_sum"], rel=RTOL)
    assert tree_stats["actor/grad_norm"] == pytest.approx(flat_stats["actor/grad_norm"], rel=RTOL)
    assert tree_stats["actor/loss_tokens"] == flat_stats["actor/loss_tokens"]
    shared_within = tree_module.flat_subtree_tokens(tree.model, max_tokens)
    assert (
        tree_stats["actor/tree_tokens"] == build_prefix_tree(batch.sequences, min_saved_tokens, shared_within).n_tokens
    )
    assert_same_gradients(tree.model, flat.model)


def search_agent_group(model_dir, episodes: int = 4, turns: int = 6) -> list[Trajectory]:
    """A GRPO group of the search agent's real episodes: the tiny model decoded by the embedded engine,
    ``turns`` turns each (it never answers), the environment's replies between its turns; rewards drawn
    at random (an untrained model earns none), so the group's advantages are not all 0."""
    question = next(q for q in build_world(0).questions if q.hops == 3)
    model = InProcessModel(model_dir)
    workflow = SearchAgentWorkflow(max_turns=turns, top_k=2, max_context_tokens=1024)

    async def group(pool):
        settings = EpisodeSettings(model.generate, load_tokenizer(model_dir), Sampling(max_new_tokens=6), Scorer(pool))
        runs = [run_episode(workflow, EpisodeContext(settings), example_of(question)) for _ in range(episodes)]
        return [record for records in await asyncio.gather(*runs) for record in records]

    try:
        with RewardPool(SEARCH_REWARD) as pool:
            records = asyncio.run(group(pool))
    finally:
        model.engine.stop()
    generator = torch.Generator().manual_seed(0)
    for record in records:
        record.group_id, record.rewards = "q0", [Reward(float(torch.rand(1, generator=generator)), step=0)]
    return records


def test_an_agent_groups_episodes_train_as_one_tree_exactly_as_flat(policy, tiny_model_dir):
    """Multi-turn episodes as the trainer takes them (``build_batch``: each episode one sequence, its
    turns back to back, the environment's tokens out of the loss) share their prompt as one prefix tree;
    the PPO update on it equals the flat engine's."""
    records = search_agent_group(tiny_model_dir)
    assert all(len(r.segments) == 6 for r in records)
    cfg = ActorConfig()
    (batch,) = split_minibatches(build_batch(records, cfg, 6, 1.0), records, cfg, 6)
    assert all(0 in mask[mask.index(1) :] for mask in batch.loss_masks)  # holes: the environment's tokens
    assert build_prefix_tree(batch.sequences).compression > 1.15  # 4 episodes share the prompt
    tree, flat = engine(policy, "dta", max_tokens=1024), engine(policy, "off", max_tokens=1024)
    tree_stats = PPOActor(tree, cfg).update([batch])
    flat_stats = PPOActor(flat, cfg).update([batch])
    assert tree_stats["actor/loss"] == pytest.approx(flat_stats["actor/loss"], rel=RTOL, abs=1e-6)  # a sum near 0
    assert tree_stats["actor/loss_tokens"] == flat_stats["actor/loss_tokens"] > 0
    assert tree_stats["actor/tree_tokens"] == build_prefix_tree(batch.sequences).n_tokens
    assert_same_gradients(tree.model, flat.model)


def test_tree_training_computes_in_bfloat16_like_the_flat_engine(policy):
    """``model.compute_dtype=bfloat16`` holds for the tree pass too (attention in float32 on a CPU, as the
    flat engine's): its gradients differ from float32's by bfloat16's rounding, and from the flat bfloat16
    engine's by no more than that."""
    batch = grpo_groups(groups=3, prompts=(30, 10, 3))
    steps = {}
    for name, tree_training, dtype in [
        ("tree16", "dta", "bfloat16"),
        ("flat16", "off", "bfloat16"),
        ("flat32", "off", "float32"),
    ]:
        steps[name] = engine(policy, tree_training, max_tokens=4096, compute_dtype=dtype)
        PPOActor(steps[name], ActorConfig()).update([batch])
    grads = {name: torch.cat([p.grad.flatten() for p in e.model.parameters()]) for name, e in steps.items()}
    rounding = relative_difference(grads["flat16"], grads["flat32"])
    assert 1e-4 < rounding < 0.1  # bfloat16 did the matmuls, and its rounding is what it is
    assert 1e-4 < relative_difference(grads["tree16"], grads["flat32"]) < 2 * rounding
    assert relative_difference(grads["tree16"], grads["flat16"]) < 2 * rounding


def test_critic_value_loss_step_equals_flat(tiny_model_dir):
    torch.manual_seed(0)
    critic = load_critic(tiny_model_dir)
    batch = grpo_groups(seed=1)
    generator = torch.Generator().manual_seed(2)
    batch.fields["old_values"] = [torch.randn(len(s), generator=generator) for s in batch.sequences]
    batch.fields["returns"] = [torch.randn(len(s), generator=generator) for s in batch.sequences]

    def loss(outputs, packed, f):
        return value_loss(outputs["values"], f["old_values"], f["returns"], packed.target_mask, f["weights"]), {}

    tree, flat = engine(critic, "dta", ValueOutputs()), engine(critic, "off", ValueOutputs())
    tree_stats, flat_stats = tree.train_step(batch, loss), flat.train_step(batch, loss)
    assert tree_stats["loss"] == pytest.approx(flat_stats["loss"], rel=RTOL)
    assert_same_gradients(tree.model, flat.model)


@pytest.mark.parametrize(
    "names",
    [("input_ids", "cache", "use_cache"), ("input_ids", "past_key_values", "use_cache"), ("input_ids", "use_cache")],
)
def test_the_cache_goes_by_the_name_the_model_forward_takes(names, policy):
    """transformers renamed the forward's ``past_key_values`` to ``cache`` within 5.x (5.17 takes the old
    name, 5.24 the new one); a forward given the other files it under ``**kwargs`` and fills no cache (an
    H200 run on 5.17 failed so). The installed version's own Qwen2 names one of the two."""

    def forward(**_):
        return None

    forward.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in names]
        + [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
    )
    model = SimpleNamespace(base_model=SimpleNamespace(forward=forward))
    if len(names) == 2:
        with pytest.raises(UserError, match="takes neither cache nor past_key_values"):
            cache_keyword(model)
    else:
        assert cache_keyword(model) == names[1]
    assert cache_keyword(policy) in inspect.signature(policy.base_model.forward).parameters


def test_a_sequence_deeper_than_the_context_is_one_user_error(policy):
    too_long = policy.config.max_position_embeddings + 1
    batch = ppo_batch([[5] * too_long, [5, 6]], seed=0, per_position_temperatures=False)
    with pytest.raises(UserError, match=f"sequence of {too_long} tokens, deeper than the model's context"):
        engine(policy, "dta").train_step(batch, PPOActor(engine(policy, "off"), ActorConfig())._policy_loss)


def test_an_empty_batch_is_one_user_error(policy):
    with pytest.raises(UserError, match="empty batch"):
        engine(policy, "dta").train_step(SequenceBatch([], []), lambda outputs, packed, fields: (0.0, {}))


@pytest.mark.parametrize(
    "dims, recompute, message",
    [
        (ParallelDims(tp=2), "none", "data-parallel replicas only"),
        (ParallelDims(pp=2, dp=2, fsdp=True), "none", "data-parallel replicas only"),
        (ParallelDims(cp=2), "none", "data-parallel replicas only"),
        (ParallelDims(dp=2, ep=2), "none", "data-parallel replicas only"),
        (None, "full", "actor.recompute=full"),
    ],
)
def test_unsupported_layouts_are_one_user_error(dims, recompute, message):
    mesh = None if dims is None else SimpleNamespace(dims=dims)
    with pytest.raises(UserError, match=message):
        check_tree_layout("dta", mesh, recompute, PolicyOutputs())


AUTO_OPTIONS = {
    "actor.engine": ("torch", "megatron"),
    "actor.importance_level": ("token", "sequence"),
    "actor.lora.rank": (0, 4),
    "actor.recompute": ("none", "full"),
}


@pytest.mark.parametrize("choice", list(itertools.product(*AUTO_OPTIONS.values())))
def test_auto_tree_training_is_dta_exactly_where_the_trainer_builds_dta(choice, tiny_model_dir):
    """Every combination of the options tree training depends on, in one process: ``auto`` resolves to dta
    where ``resolve`` and ``build_actor`` build the actor with dta, and to off where they refuse dta (a
    combination refused whatever the tree training, such as LoRA on Megatron, is refused with auto too)."""
    overrides = [f"model.path={tiny_model_dir}", *(f"{key}={value}" for key, value in zip(AUTO_OPTIONS, choice))]

    def settled(tree_training: str):
        return resolve(load_config(None, [*overrides, tree_training]), Host.probe()).cfg

    try:
        resolved = settled("actor.tree_training=auto").actor.tree_training
    except UserError:
        resolved = "refused"
    try:
        build_actor(settled("actor.tree_training=dta"), None)
        built = True
    except UserError as exc:
        assert "tree_training" in str(exc) or resolved == "refused"
        built = False
    assert (resolved == "dta") if built else (resolved in ("off", "refused"))


@pytest.mark.parametrize(
    "layout",
    [
        (),
        ("actor.parallel.fsdp=true",),
        ("actor.parallel.tp=2",),
        ("actor.parallel.pp=2",),
        ("actor.parallel.cp=2",),
        ("actor.parallel.ep=2",),
        ("actor.parallel.dp=3",),
        ("actor.parallel.allocation=megatron:d2p1t1",),
        ("actor.parallel.allocation=megatron:d1p2t1",),
        ("actor.parallel.groups=[[1,1,1],[1,1,1]]",),
    ],
)
def test_auto_tree_training_on_two_ranks_is_dta_exactly_where_the_layout_checks_accept_dta(layout):
    """Two trainer processes in each layout: dta where ``resolve`` (the layout, the training groups' rule) and
    the engine's layout check accept it, off where they refuse it (an impossible layout is refused either way)."""

    def settle(tree_training: str):
        return resolve(load_config(None, ["rl.trainer_processes=2", *layout, tree_training]), Host("cpu"))

    try:
        check_tree_layout(
            "dta", SimpleNamespace(dims=settle("actor.tree_training=dta").layout.groups[0]), "none", PolicyOutputs()
        )
        accepted = True
    except UserError:
        accepted = False
    try:
        resolved = settle("actor.tree_training=auto").cfg.actor.tree_training
    except UserError:
        resolved = "refused"
    assert (resolved == "dta") if accepted else (resolved in ("off", "refused"))
    assert accepted == (layout in [(), ("actor.parallel.fsdp=true",), ("actor.parallel.allocation=megatron:d2p1t1",)])


TREE_LAYOUTS = {"dp2": (), "fsdp2": ("actor.parallel.fsdp=true",)}
# M2PO: its trust region is one bound over the batch, gathered from the ranks' tree parts (the synthetic
# batch's behaviour logprobs are ~4 nats off the random model's: a bound of 16 masks part of the tokens)
ESTIMATORS = {
    "grpo": (),
    "ppo_critic": ("actor.adv_estimator=ppo",),
    "m2po": ("actor.policy_loss=m2po", "actor.m2_threshold=16"),
}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("layout", TREE_LAYOUTS)
def test_tree_training_over_two_replicas_takes_the_flat_step_of_one_process(
    layout, estimator, tiny_model_dir, tmp_path_factory
):
    """The trainer's own path on two gloo ranks (``TrainerRanks`` cutting each minibatch's tree into two
    parts, each rank training its part depth first, one reduction): two optimizer steps of the actor (and
    the critic) equal the flat engine's in one process. This batch's prompts are short: the default
    ``actor.tree_min_saved_tokens`` of 64 would recompute them all, so prefixes saving 8 are shared here."""
    folder = tmp_path_factory.mktemp(f"tree-{layout}-{estimator}")
    reference = flat_single_process(str(tiny_model_dir), estimator, str(tmp_path_factory.getbasetemp()))
    ours = run_ranks(
        2,
        tiny_model_dir,
        folder / "tree.pt",
        *STEP,
        *ESTIMATORS[estimator],
        *TREE_LAYOUTS[layout],
        "actor.tree_training=dta",
        "actor.tree_min_saved_tokens=8",
    )
    assert ours["stats"]["actor/tree_tokens"] < ours["stats"]["train/tokens"]  # the groups' prompts shared
    assert_same_step(ours, reference)
    kept, tokens = ours["stats"]["actor/kept_tokens"], ours["stats"]["actor/loss_tokens"]
    assert kept == reference["stats"]["actor/kept_tokens"] and (0 < kept < tokens) == (estimator == "m2po")


@functools.cache
def flat_single_process(model_dir: str, estimator: str, folder: str) -> dict:
    return run_ranks(1, model_dir, f"{folder}/flat-{estimator}.pt", *STEP, *ESTIMATORS[estimator])


@pytest.mark.parametrize(("folder", "trains_trees"), [("tiny_llama_dir", True), ("tiny_gemma3_dir", False)])
def test_tree_training_takes_a_model_by_its_family(folder, trains_trees, request):
    """Llama's tree step is the flat step; Gemma 3's sliding-window layers would cut a prefix's cached keys
    at the window, so ``auto`` settles to off and dta is one line, at resolve and in the engine."""
    folder = request.getfixturevalue(folder)
    auto = resolve(load_config(None, [f"model.path={folder}", "actor.tree_training=auto"]), Host.probe())
    assert auto.cfg.actor.tree_training == ("dta" if trains_trees else "off")
    if trains_trees:
        prompt = [5 + 7 * i for i in range(9)]
        sequences = [prompt + [11 + 13 * i + j for j in range(3 + i)] for i in range(3)]
        assert_tree_step_exact(load_model(folder), ppo_batch(sequences, 0, False), 24, 0)
        return
    with pytest.raises(UserError, match="sliding-window|gemma3_text.*actor.tree_training=off"):
        resolve(load_config(None, [f"model.path={folder}", "actor.tree_training=dta"]), Host.probe())
    with pytest.raises(UserError, match="gemma3_text.*actor.tree_training=off"):
        engine(load_model(folder), "dta")
