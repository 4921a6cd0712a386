"""Tree training (AReaL-DTA, ``actor.tree_training=dta``): a depth-first forward and backward over a
batch's prefix tree (``algo.prefix_tree``), so a prefix that several sequences share is computed once.

Each node's segment runs through the Hugging Face decoder with its ancestors' K/V as the cache
(positions continuing from its depth). Its children read that cache through leaf copies (detached,
requiring grad), whose ``.grad`` sums what every descendant's attention sent back; when the node's
subtree is done, one backward through the node's own forward carries its loss and those K/V
gradients, and its graph is freed. Gradients are exact, and only the graphs of one root-to-leaf path
are alive at a time (each node's attention keeps the K/V of its whole prefix).

A node's loss is ``loss_fn`` over its tokens as each sequence through it sees them: one piece per
sequence, the node's segment plus that sequence's next token (its child's first token, which the
segment's last position predicts), with the sequence's own mask, temperatures and fields. Losses that
are sums of per-token terms with the whole minibatch's normaliser in the weights (decoupled PPO at the
token level, the value loss, SFT's NLL) then add up over nodes to the flat loss; GSPO's per-sequence
ratio does not (``build`` refuses it). A trained token that several sequences share goes through the
LM head once per sequence.

One process only for now: data-parallel wrappers reduce in each backward and expect one forward per
step, tp/pp/cp shard what this pass reads whole, and activation recomputation would rerun the cache
updates; ``check_tree_layout`` refuses them with one line.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

from areal_hpc.algo.packing import PackedBatch, pack
from areal_hpc.algo.prefix_tree import PrefixTree
from areal_hpc.engines.base import LossFn
from areal_hpc.engines.sequence_batch import SequenceBatch
from areal_hpc.errors import UserError
from areal_hpc.parallel.mesh import TrainMesh

TREE_TRAINING = ("off", "dta")
KeyValues = list[tuple[torch.Tensor, torch.Tensor]]  # per decoder layer: [1, kv heads, tokens, head dim] each


def check_tree_layout(tree_training: str, mesh: TrainMesh | None, recompute: str, forward_fn) -> None:
    """Raise ``UserError`` where ``tree_training`` cannot run on this engine's layout."""
    if tree_training not in TREE_TRAINING:
        raise UserError(f"actor.tree_training={tree_training!r}; valid: {', '.join(TREE_TRAINING)}")
    if tree_training == "off":
        return
    if mesh is not None and mesh.dims.world_size > 1:
        raise UserError(f"actor.tree_training=dta runs in one trainer process for now, not on the layout "
                        f"{mesh.dims}; set rl.trainer_processes=1 or actor.tree_training=off")
    if recompute != "none":
        raise UserError(f"actor.tree_training=dta does not support actor.recompute={recompute} (the rerun would "
                        f"append to the prefix cache again); set actor.recompute=none")
    if not hasattr(forward_fn, "head"):
        raise TypeError("tree training needs a forward_fn with a head (engines.torch.outputs.StageOutputs)")


def node_pieces(tree: PrefixTree, n: int,
                batch: SequenceBatch) -> tuple[list[int], PackedBatch, dict[str, torch.Tensor]]:
    """(rows, packed pieces, packed fields) of node n: per sequence through it, its positions
    [start, stop] (stop: the next token, where the sequence goes on). ``rows`` index the node's hidden
    states, ``len(segment)`` standing for the next token (which predicts nothing here)."""
    node = tree.nodes[n]
    rows, pieces, masks, temperatures = [], [], [], []
    fields: dict[str, list[torch.Tensor]] = {name: [] for name in batch.fields}
    for s in node.sequences:
        stop = min(node.stop + 1, len(batch.sequences[s]))
        rows += range(stop - node.start)
        pieces.append(batch.sequences[s][node.start:stop])
        masks.append(batch.loss_masks[s][node.start:stop])
        if batch.temperatures is not None:
            temperatures.append(batch.temperatures[s][node.start:stop])
        for name, values in batch.fields.items():
            fields[name].append(values[s][node.start:stop])
    packed = pack(pieces, masks, torch.cat(temperatures) if temperatures else None)
    return rows, packed, {name: torch.cat(values) for name, values in fields.items()}


def tree_train_pass(model: torch.nn.Module, head: Callable, tree: PrefixTree, batch: SequenceBatch,
                    loss_fn: LossFn) -> list[dict[str, float]]:
    """Accumulate into ``model``'s gradients those of Σ_nodes ``loss_fn`` over ``batch`` (whose
    sequences ``tree`` was built from), depth first. ``head(model, hidden, packed)``: the outputs
    ``loss_fn`` reads (``StageOutputs.head``). Returns each node's statistics (nodes without a
    trained target have no loss and none)."""
    device = next(model.parameters()).device
    parts = []

    def visit(n: int, prefix: KeyValues) -> None:
        node = tree.nodes[n]
        cache = DynamicCache(config=model.config)
        for layer, (keys, values) in enumerate(prefix):
            cache.update(keys, values, layer)
        tokens = torch.tensor([node.tokens], device=device)
        positions = torch.arange(node.start, node.stop, device=device)[None]
        hidden = model.base_model(input_ids=tokens, position_ids=positions, cache=cache,
                                  use_cache=True).last_hidden_state[0]
        rows, packed, fields = node_pieces(tree, n, batch)
        packed, fields = packed.to(device), {name: values.to(device) for name, values in fields.items()}
        tensors, gradients = [], []
        if packed.n_targets:
            padded = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])  # the row of a next token
            loss, stats = loss_fn(head(model, padded[torch.tensor(rows, device=device)], packed), packed, fields)
            parts.append({"loss": loss.item(), **stats})
            tensors, gradients = [loss], [torch.ones_like(loss)]
        cached = [(layer.keys, layer.values) for layer in cache.layers]  # the whole prefix through this node
        leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in cached]
        for child in node.children:
            visit(child, leaves)
        for through, leaf in zip((t for kv in cached for t in kv), (t for kv in leaves for t in kv)):
            if leaf.grad is not None:
                tensors.append(through)
                gradients.append(leaf.grad)
        if tensors:
            torch.autograd.backward(tensors, gradients)

    for root in tree.roots:
        visit(root, [])
    return parts
