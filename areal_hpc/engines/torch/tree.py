"""Tree training (AReaL-DTA, ``actor.tree_training=dta``): a depth-first forward and backward over a
batch's prefix tree (``algo.prefix_tree``), so a prefix that several sequences share is computed once.

The pass goes down the tree a level at a time, depth first. A node whose whole subtree holds at most
``FLAT_SUBTREE_TOKENS`` tokens runs as one segment, the subtree flattened in pre-order under a tree mask
(each position attends to its own branch: a GRPO group's prompt and its short answers in one forward,
with no copy of the prompt's K/V per answer; on the quickstart's update 0.68x the time of a level each,
and up to ~750-token subtrees faster on both presets, ``Segments``); it needs the written-out forward.
Any other node runs with the chain of single children below it (``unary_run``: the turns of one agent
episode) as one causal segment. A level's segments
run in padded chunks (each within ``max_tokens`` rows, its copies of the prefixes included, longest
first, padding kept small), each row over its parent's K/V (gathered from the chunk above, padded to
the longest under an attention mask), positions continuing from its depth: on a CPU through the
written-out Qwen2/Qwen3 forward of ``models.segment_forward`` where it applies, else the model's own
forward over a Hugging Face cache. A wave of chunks (within ``max_tokens`` forwarded rows) runs forward, then the level
below all their children, then their backwards. Children read the cache through leaf copies (detached,
requiring grad), whose ``.grad`` sums what every descendant's attention sent back; one backward
through a chunk's forward then carries its loss and those K/V gradients, and its graph is freed.
Gradients are exact, and only one wave per level of the path being trained is alive at a time.

A node's loss is ``loss_fn`` over its tokens as each sequence through it sees them: one piece per
sequence that trains a token there, the node's segment (from the first position whose next token is
trained) plus that sequence's next token (its child's first token, which the segment's last position
predicts), with the sequence's own mask, temperatures and fields. Losses that are sums of per-token
terms with the whole minibatch's normaliser in the weights (decoupled PPO at the token level, the value
loss, SFT's NLL) then add up over nodes to the flat loss; GSPO's per-sequence ratio does not (``build``
refuses it). A trained token that several sequences share goes through the
LM head once per sequence.

Data parallelism (replicate or FSDP2 over ``dp``): each replica trains its own part of the minibatch's
tree (``algo.tree_balance`` cuts the depth-first order). Its parameters are gathered once, before the
pass, and gradients accumulate locally; one idle pass at the end reduces them (so replicas may run
different numbers of forwards). tp/pp/cp/ep shard what this pass reads whole, and activation
recomputation would rerun the cache updates: ``check_tree_layout`` refuses them with one line.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from areal_hpc.algo.packing import PackedBatch, pack
from areal_hpc.algo.prefix_tree import PrefixTree
from areal_hpc.builtins import check_tree_training
from areal_hpc.engines.base import LossFn
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.errors import UserError
from areal_hpc.models.segment_forward import segment_forward, supports_segment_forward
from areal_hpc.models.varlen import SDPA_FLOAT32, packed_attention
from areal_hpc.parallel.mesh import TrainMesh

TREE_TRAINING = ("off", "dta")
KeyValues = list[tuple[torch.Tensor, torch.Tensor]]


def check_tree_layout(
    tree_training: str, mesh: TrainMesh | None, recompute: str, forward_fn, model_config: dict[str, Any] | None = None
) -> None:
    """Raise ``UserError`` where ``tree_training`` cannot run on this engine's layout or model (its config.json)."""
    if tree_training not in TREE_TRAINING:
        raise UserError(f"actor.tree_training={tree_training!r}; valid: {', '.join(TREE_TRAINING)}")
    if tree_training == "off":
        return
    check_tree_training(model_config or {})
    if mesh is not None and (mesh.dims.world_size != mesh.dims.dp or mesh.dims.ep > 1):
        raise UserError(
            f"actor.tree_training=dta runs over data-parallel replicas only (dp, with or without "
            f"fsdp), not on the layout {mesh.dims}; set tp=pp=cp=ep=1 or actor.tree_training=off"
        )
    if recompute != "none":
        raise UserError(
            f"actor.tree_training=dta does not support actor.recompute={recompute} (the rerun would "
            f"append to the prefix cache again); set actor.recompute=none"
        )
    if not hasattr(forward_fn, "head"):
        raise TypeError("tree training needs a forward_fn with a head (engines.torch.outputs.StageOutputs)")


def unary_run(tree: PrefixTree, n: int) -> list[int]:
    """Node n and the chain below it while a node has exactly one child (where sequences end without
    branching, as an agent's turns do): one causal segment, forwarded at once."""
    run = [n]
    while len(tree.nodes[run[-1]].children) == 1:
        run.append(tree.nodes[run[-1]].children[0])
    return run


class Segments:
    """The segments a pass forwards: node n's whole subtree as one row under a tree mask where it holds
    at most ``flatten_within`` tokens (a GRPO group's prompt and its short answers: one forward instead
    of a level each, and no copy of the prompt's K/V per answer), else its ``unary_run``."""

    def __init__(self, tree: PrefixTree, flatten_within: int):
        self.tree, self.flatten_within = tree, flatten_within
        self.subtree_tokens, self.subtree_nodes = [len(node.tokens) for node in tree.nodes], [1] * len(tree.nodes)
        for n in range(len(tree.nodes) - 1, -1, -1):  # pre-order: children after their parent
            if (parent := tree.nodes[n].parent) >= 0:
                self.subtree_tokens[parent] += self.subtree_tokens[n]
                self.subtree_nodes[parent] += self.subtree_nodes[n]

    def of(self, n: int) -> list[int]:
        """Node n's segment, its nodes in pre-order (a subtree is a range of them)."""
        if self.subtree_tokens[n] <= self.flatten_within:
            return list(range(n, n + self.subtree_nodes[n]))
        return unary_run(self.tree, n)


def run_tokens(tree: PrefixTree, run: list[int]) -> list[int]:
    return [t for n in run for t in tree.nodes[n].tokens]


def run_positions(tree: PrefixTree, segment: list[int], width: int) -> list[int]:
    """Each token's position in its sequences (its depth), the padding after them at 0."""
    positions = [tree.nodes[n].start + i for n in segment for i in range(len(tree.nodes[n].tokens))]
    return positions + [0] * (width - len(positions))


def is_chain(tree: PrefixTree, segment: list[int]) -> bool:
    return all(tree.nodes[b].parent == a for a, b in itertools.pairwise(segment))


def tree_mask(tree: PrefixTree, segment: list[int], width: int) -> torch.Tensor:
    """[width, width] bool: within a row holding ``segment`` (pre-order, then padding), position i
    attends to j ≤ i where j's node is i's own or one of its ancestors; the padding attends causally
    (no real position reads it)."""
    local = {n: k for k, n in enumerate(segment)}
    lineage = [[False] * (len(segment) + 1) for _ in segment] + [[True] * (len(segment) + 1)]  # the padding's last
    for k, n in enumerate(segment):
        while n in local:  # the node, then its ancestors within the segment
            lineage[k][local[n]] = True
            n = tree.nodes[n].parent
    owner = [local[n] for n in segment for _ in tree.nodes[n].tokens]
    owner = torch.tensor(owner + [len(segment)] * (width - len(owner)))
    return torch.tensor(lineage)[owner[:, None], owner[None, :]] & torch.ones(width, width, dtype=torch.bool).tril()


@dataclass
class Prefix:
    """What a chunk's children continue from: its K/V (leaf copies whose ``.grad`` gathers what the
    children's attention sends back) and which positions of each row are its own (False: padding)."""

    states: KeyValues  # per decoder layer: [rows, kv heads, positions, head dim] each
    valid: torch.Tensor  # [rows, positions] bool


# A chunk's padding stays within this share of its rows plus this many rows: padded rows cost compute,
# another chunk costs a forward's overhead (on the quickstart's tiny model the rows are cheap, on larger
# ones the padding is not).
PADDING_SHARE, PADDING_ROWS = 0.25, 64
# A subtree of at most this many tokens is one row under a tree mask (faster than a level at a time below
# 400-750 tokens on the tiny and small presets: bench/results/tree_flat_subtrees-*.md).
FLAT_SUBTREE_TOKENS = 512
PREFIX_WEIGHT = 0.25  # a row's copied prefix position holds K/V only, a fraction of a forwarded token's memory


def level_chunks(lengths: list[int], prefixes: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of a level's runs (their ``lengths``, and the ``prefixes`` they read) longest first, cut
    into chunks of at most ``max_tokens`` rows (count × (``PREFIX_WEIGHT`` × longest prefix + longest
    run): the padded forward and its copies of the prefixes) whose padding stays within
    ``PADDING_SHARE`` of their rows plus ``PADDING_ROWS``. A run over the budget gets a chunk of its own."""
    chunks: list[list[int]] = []
    widest, real = (0, 0), 0  # the current chunk's longest prefix and run, and its tokens
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        grown = (max(widest[0], prefixes[i]), widest[1])
        count = len(chunks[-1]) + 1 if chunks else 0
        padding, rows = count * widest[1] - real - lengths[i], real + lengths[i]
        if (
            chunks
            and count * (PREFIX_WEIGHT * grown[0] + grown[1]) <= max_tokens
            and padding <= PADDING_SHARE * rows + PADDING_ROWS
        ):
            chunks[-1].append(i)
            widest, real = grown, real + lengths[i]
        else:
            chunks.append([i])
            widest, real = (prefixes[i], lengths[i]), lengths[i]
    return chunks


def waves(chunks: list[list[int]], widths: list[int], max_tokens: int) -> list[list[list[int]]]:
    """Consecutive chunks grouped while their forwarded rows (count × ``widths`` of each: its longest
    run) stay within ``max_tokens``: the chunks forwarded before the next level starts (their prefix
    copies, K/V only, count against each chunk's budget instead)."""
    grouped: list[list[list[int]]] = []
    rows = 0
    for chunk, width in zip(chunks, widths):
        if grouped and rows + len(chunk) * width <= max_tokens:
            grouped[-1].append(chunk)
            rows += len(chunk) * width
        else:
            grouped.append([chunk])
            rows = len(chunk) * width
    return grouped


@dataclass
class PackedFields:
    """A batch's per-position fields and temperatures concatenated, and where each sequence starts."""

    starts: list[int]
    fields: dict[str, torch.Tensor]
    temperatures: torch.Tensor | None

    @classmethod
    def of(cls, batch: SequenceBatch) -> PackedFields:
        lengths = [len(s) for s in batch.sequences]
        return cls(
            list(itertools.accumulate(lengths, initial=0))[:-1],
            {name: torch.cat(values) for name, values in batch.fields.items()},
            None if batch.temperatures is None else torch.cat(batch.temperatures),
        )


def chunk_pieces(
    tree: PrefixTree, chunk: list[list[int]], batch: SequenceBatch, width: int, whole: PackedFields
) -> tuple[list[int], PackedBatch, dict[str, torch.Tensor]] | None:
    """(rows, packed pieces, packed fields) of a chunk's segments (None where no piece trains
    anything): per node and sequence through it, its positions from the first one whose next token
    it trains to ``stop`` (the next token, where the sequence goes on); a sequence training nothing
    in the node has no piece. ``rows`` index the chunk's hidden states flattened with one zero row
    after each segment's ``width`` rows, which stands for the next token (a piece's last position:
    it predicts nothing here). The pieces' fields and temperatures are gathered from ``whole`` in one
    indexing each."""
    rows, pieces, masks, positions = [], [], [], []
    for b, segment in enumerate(chunk):
        row, zero = b * (width + 1), b * (width + 1) + width  # where the node's tokens start; the zero row
        for node in (tree.nodes[n] for n in segment):
            for s in node.sequences:
                stop = min(node.stop + 1, len(batch.sequences[s]))
                trained = batch.loss_masks[s][node.start + 1 : stop]  # the targets of positions start .. stop - 2
                if not any(trained):
                    continue
                first = node.start + next(k for k, m in enumerate(trained) if m)
                # the next token (the child's first, at node.stop) ends the piece: it predicts nothing here
                rows += [row + p - node.start if p < node.stop else zero for p in range(first, stop)]
                pieces.append(batch.sequences[s][first:stop])
                masks.append(batch.loss_masks[s][first:stop])
                positions += range(whole.starts[s] + first, whole.starts[s] + stop)
            row += len(node.tokens)
    if not pieces:
        return None
    where = torch.tensor(positions)
    packed = pack(pieces, masks, None if whole.temperatures is None else whole.temperatures[where])
    return rows, packed, {name: values[where] for name, values in whole.fields.items()}


Item = tuple[list[int], "Prefix | None", int]  # a run, the prefix it continues (None: a root), its row there


@dataclass
class Forwarded:
    """A chunk after its forward, waiting for its backward: its loss, the K/V its forward appended
    to, their leaf copies its children read, and those children."""

    loss: torch.Tensor | None
    cached: KeyValues
    below: Prefix
    children: list[Item]


def gather_prefixes(items: list[Item]) -> Prefix | None:
    """The K/V each item continues from (its row of its parent chunk's; items grouped by parent),
    padded to the longest, and which positions are its own; None for roots."""
    if items[0][1] is None:
        return None
    groups: list[tuple[Prefix, list[int]]] = []
    for _, parent, row in items:
        if not groups or groups[-1][0] is not parent:
            groups.append((parent, []))
        groups[-1][1].append(row)
    longest = max(parent.valid.shape[1] for parent, _ in groups)
    indices = [torch.tensor(rows, device=parent.valid.device) for parent, rows in groups]

    def stacked(select, trailing: int) -> torch.Tensor:
        """The groups' rows of ``select(parent)``, padded with zeros (False) to ``longest`` positions
        (the dimension before the ``trailing`` ones)."""
        parts = [select(parent).index_select(0, rows) for (parent, _), rows in zip(groups, indices)]
        return torch.cat(
            [torch.nn.functional.pad(t, (0, 0) * trailing + (0, longest - t.shape[-1 - trailing])) for t in parts]
        )

    states = [
        (stacked(lambda p: p.states[layer][0], 1), stacked(lambda p: p.states[layer][1], 1))  # noqa: B023 - called here
        for layer in range(len(groups[0][0].states))
    ]
    return Prefix(states, stacked(lambda p: p.valid, 0))


def writes_out_segments(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether the pass runs ``models.segment_forward`` (which takes tree masks) on this model."""
    return device.type == "cpu" and supports_segment_forward(model)


def segment_forward_of(model: torch.nn.Module, device: torch.device):
    """``decode(model, tokens, positions, prefix, tree_masks, own)`` -> (hidden states, per layer the K/V
    of prefix and segment): ``models.segment_forward`` where ``writes_out_segments`` (computing the
    ``own`` positions only), else the model's own forward over a Hugging Face cache (causal segments
    only: its mask builders take no tree). On a CPU attention runs in float32 under a bfloat16 autocast
    (its bfloat16 backward is the slow part)."""
    if writes_out_segments(model, device):

        def written_out(model, tokens, positions, prefix: Prefix | None, tree_masks: torch.Tensor | None, own):
            return segment_forward(
                model,
                tokens,
                positions,
                None if prefix is None else prefix.states,
                None if prefix is None else prefix.valid,
                torch.float32,
                tree_masks,
                own,
            )

        return written_out
    attention = SDPA_FLOAT32 if device.type == "cpu" else model.config._attn_implementation
    keyword = cache_keyword(model)

    def hugging_face(model, tokens, positions, prefix: Prefix | None, tree_masks: None, own):
        cache, mask = DynamicCache(config=model.config), None
        if prefix is not None:
            for layer, (keys, values) in enumerate(prefix.states):
                cache.update(keys, values, layer)
            if not bool(prefix.valid.all()):  # each row reads its own prefix, not the padding after it
                mask = torch.cat([prefix.valid, torch.ones_like(tokens, dtype=torch.bool)], 1).long()
        with packed_attention(model, attention):
            hidden = model.base_model(
                input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True, **{keyword: cache}
            ).last_hidden_state
        return hidden, [(layer.keys, layer.values) for layer in cache.layers]

    return hugging_face


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword the model's forward takes its K/V cache by: ``cache`` in recent transformers 5.x,
    ``past_key_values`` before (5.17, say). A forward given the other name files it under ``**kwargs``
    and fills no cache at all."""
    parameters = inspect.signature(model.base_model.forward).parameters
    for keyword in ("cache", "past_key_values"):
        if keyword in parameters:
            return keyword
    raise UserError(
        f"tree training needs a model whose forward takes a K/V cache; "
        f"{type(model.base_model).__name__}.forward takes neither cache nor past_key_values"
    )


def flat_subtree_tokens(model: torch.nn.Module, max_tokens: int) -> int:
    """The largest subtree ``tree_train_pass`` forwards as one row on ``model``: 0 where its forward takes
    no tree mask."""
    return min(FLAT_SUBTREE_TOKENS, max_tokens) if writes_out_segments(model, next(model.parameters()).device) else 0


def tree_train_pass(
    root: torch.nn.Module, tree: PrefixTree, batch: SequenceBatch, loss_fn: LossFn, max_tokens: int, flatten_within: int
) -> list[dict[str, float]]:
    """Accumulate into the model's gradients those of Σ_nodes ``loss_fn`` over ``batch`` (whose
    sequences ``tree`` was built from), depth first. ``root``: the engine's ``PackedForward`` (every
    forward goes through it, under the data-parallel hooks); its ``forward_fn.head`` gives the
    outputs ``loss_fn`` reads; subtrees of at most ``flatten_within`` tokens run as one row each
    (``flat_subtree_tokens``, as the tree was built with). Returns each chunk's statistics (chunks
    without a trained target have no loss and none)."""
    model, head = root.model, root.forward_fn.head
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and (deepest := max(len(s) for s in batch.sequences)) > context:
        raise UserError(
            f"tree training got a sequence of {deepest} tokens, deeper than the model's context "
            f"(max_position_embeddings={context}); cap prompt + max_new_tokens at {context}"
        )
    device = next(model.parameters()).device
    decode = segment_forward_of(model, device)
    segments = Segments(tree, flatten_within)
    whole = PackedFields.of(batch)
    parts = []

    def forward(chunk: list[Item]) -> Forwarded:
        runs, prefix = [nodes for nodes, _, _ in chunk], gather_prefixes(chunk)
        row_tokens = [run_tokens(tree, nodes) for nodes in runs]
        width = max(map(len, row_tokens))
        # right-padded: no real position attends to the padding
        tokens = torch.tensor([row + [0] * (width - len(row)) for row in row_tokens], device=device)
        positions = torch.tensor([run_positions(tree, nodes, width) for nodes in runs], device=device)
        masks = (
            None
            if all(is_chain(tree, nodes) for nodes in runs)
            else torch.stack([tree_mask(tree, nodes, width) for nodes in runs]).to(device)
        )
        own = torch.arange(width, device=device) < torch.tensor(list(map(len, row_tokens)), device=device)[:, None]
        valid = own if prefix is None else torch.cat([prefix.valid, own], 1)
        pieces = chunk_pieces(tree, runs, batch, width, whole)
        if pieces is not None:
            rows_of, packed, fields = pieces
            packed, fields = packed.to(device), {name: values.to(device) for name, values in fields.items()}

        cached: KeyValues = []  # per layer [chunk, kv heads, positions, dim]: the prefix's and the chunk's own

        def outputs_of(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
            hidden, states = decode(model, tokens, positions, prefix, masks, own)
            cached.extend(states)
            if pieces is None:
                return None
            padded = torch.cat([hidden, hidden.new_zeros(len(chunk), 1, hidden.shape[-1])], 1).flatten(0, 1)
            return head(model, padded[torch.tensor(rows_of, device=device)], packed)

        outputs, loss = root(None, run=outputs_of), None
        if outputs is not None:
            loss, stats = loss_fn(outputs, packed, fields)
            parts.append({"loss": loss.item(), **stats})
        below = Prefix([(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in cached], valid)
        children = [
            (segments.of(child), below, b) for b, nodes in enumerate(runs) for child in tree.nodes[nodes[-1]].children
        ]  # (a whole subtree's last node is a leaf)
        return Forwarded(loss, cached, below, children)

    def backward(chunk: Forwarded) -> None:
        """Its loss and the K/V gradients its children sent back, through its forward (then freed)."""
        tensors, gradients = ([chunk.loss], [torch.ones_like(chunk.loss)]) if chunk.loss is not None else ([], [])
        for through, leaf in zip((t for kv in chunk.cached for t in kv), (t for kv in chunk.below.states for t in kv)):
            if leaf.grad is not None:
                tensors.append(through)
                gradients.append(leaf.grad)
        if tensors:
            torch.autograd.backward(tensors, gradients)

    def visit(level: list[Item]) -> None:
        """Train ``level``'s runs and everything below them: a wave of chunks forward, the level below
        their children, then their backwards."""
        order = {}
        for _, parent, _ in level:
            order.setdefault(id(parent), len(order))
        lengths = [len(run_tokens(tree, nodes)) for nodes, _, _ in level]
        prefixes = [0 if parent is None else parent.valid.shape[1] for _, parent, _ in level]
        chunks = level_chunks(lengths, prefixes, max_tokens)
        widths = [max(lengths[i] for i in chunk) for chunk in chunks]
        for wave in waves(chunks, widths, max_tokens):
            forwarded = [
                forward(sorted((level[i] for i in chunk), key=lambda item: order[id(item[1])])) for chunk in wave
            ]
            if children := [item for chunk in forwarded for item in chunk.children]:
                visit(children)
            for chunk in reversed(forwarded):
                backward(chunk)

    visit([(segments.of(n), None, 0) for n in tree.roots])
    return parts
