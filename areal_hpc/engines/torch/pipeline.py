"""Pipeline parallelism for the PyTorch-native engine: a Hugging Face decoder cut into stages over
``mesh["pp"]`` (each stage keeps its own layers; the first the embeddings, the last the final norm
and the head) and a 1F1B schedule over packed micro-batches of any length.

Why not ``torch.distributed.pipelining``: its stages infer tensor metadata once, from the first
micro-batch, and size every receive buffer by it, so packed micro-batches (each a different number
of tokens) would all be padded to the longest. Here every stage of a replica holds the same batch, so
each knows every micro-batch's length, hence every activation's shape, without asking: nothing is
padded and no metadata travels. The schedule is Megatron's non-interleaved 1F1B (at most pp - stage
micro-batches in flight per stage); sends and receives that cross are posted together, so no stage
waits on a peer that waits on it.

- Layers keep their global indices (``StageLayers``), so parameter names are the full model's and
  checkpoints, weight pushes and optimizer state need no renaming; the decoder's forward numbers them so too,
  so a model that mixes attention kinds (Gemma 3's sliding-window and global layers, each with its own RoPE
  base) gives each layer its own kind's window and RoPE table on any stage.
- Tied embeddings (the tiny models'): the last stage keeps its own copy of the embedding as the head;
  their gradients are summed over the first and last stage after the backward (Megatron's embedding
  group), so both copies take the same step, and the gradient norm counts the pair once.
- The last stage's outputs and loss statistics reach every stage (``broadcast_object_list``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from areal_hpc.errors import UserError
from areal_hpc.parallel.mesh import TrainMesh

HEADS = ("lm_head", "score")  # a causal LM's and a token classifier's (the critic's) output layer


def held_by_another_stage(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The place of a decoder layer that another stage holds: the hidden state passes unchanged."""
    return hidden_states


class StageLayers(torch.nn.ModuleDict):
    """A stage's decoder layers under their global indices. Iterating gives the stage's layers; a slice (the
    decoder's forward takes ``layers[:num_hidden_layers]``) is of the whole model's ``count`` layers, those of
    other stages passing the hidden state through, so the forward's ``enumerate`` numbers each layer as the
    whole model does and ``config.layer_types[i]`` gives it its own kind's mask and RoPE table."""

    def __init__(self, layers: dict[int, torch.nn.Module], count: int):
        super().__init__({str(i): layer for i, layer in layers.items()})
        self.count = count

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, key):
        if not isinstance(key, slice):
            return super().__getitem__(key)
        return [self._modules.get(str(i), held_by_another_stage) for i in range(self.count)[key]]


def check_stages(config, pp: int) -> None:
    """Raise ``UserError`` for a model that cannot be cut into ``pp`` stages."""
    if config.num_hidden_layers % pp:
        raise UserError(f"actor.parallel.pp={pp} must divide the model's num_hidden_layers={config.num_hidden_layers}")


def keep_stage(model: torch.nn.Module, stage: int, pp: int) -> None:
    """Drop from ``model`` what other stages hold: stage s keeps layers [s L/pp, (s+1) L/pp); only the
    first keeps the embeddings, only the last the final norm and the head."""
    decoder = model.base_model
    count = len(decoder.layers)
    first, last = stage * count // pp, (stage + 1) * count // pp
    decoder.layers = StageLayers({i: decoder.layers[i] for i in range(first, last)}, count)
    if stage > 0:
        decoder.embed_tokens = None  # a tied head keeps the parameter
    if stage < pp - 1:
        decoder.norm = torch.nn.Identity()
        for head in HEADS:
            if getattr(model, head, None) is not None:
                setattr(model, head, None)


class Pipeline:
    """The schedule of one stage of a replica's pipeline, and the transfers that make a pipelined
    model look whole: outputs and statistics on every stage, full weights on global rank 0."""

    def __init__(self, model: torch.nn.Module, mesh: TrainMesh, activation_dtype: torch.dtype):
        """``activation_dtype``: the residual stream's between stages (the parameters' under autocast,
        the compute dtype under FSDP's mixed precision)."""
        self.mesh = mesh
        self.stage, self.stages = mesh.coords["pp"], mesh.dims.pp
        self.ranks = dist.get_process_group_ranks(mesh.group("pp"))
        self.prev = self.ranks[self.stage - 1] if self.stage > 0 else None
        self.next = self.ranks[self.stage + 1] if self.stage < self.stages - 1 else None
        self.hidden_size = model.config.hidden_size
        self.dtype = activation_dtype
        self.device = mesh.device
        # The same answer on every stage: a causal LM keeps its (emptied) ``lm_head`` slot when cut.
        ties = getattr(model.config, "tie_word_embeddings", False) and "lm_head" in model._modules
        self.tied = self._tied_parameter(model) if ties else None
        self.tied_embedding_name = f"{model.base_model_prefix}.embed_tokens.weight"  # the one-process name
        self.embedding_group = mesh.pipeline_ends if ties else None

    @property
    def is_last(self) -> bool:
        return self.next is None

    def _tied_parameter(self, model: torch.nn.Module) -> torch.nn.Parameter | None:
        """Of a model that ties them: the first stage's embedding or the last stage's head, else None."""
        if self.stage not in (0, self.stages - 1):
            return None
        return model.base_model.embed_tokens.weight if self.stage == 0 else model.lm_head.weight

    # -- point to point -------------------------------------------------------------------------------

    def _buffer(self, tokens: int) -> torch.Tensor:
        return torch.empty(tokens, self.hidden_size, dtype=self.dtype, device=self.device)

    @staticmethod
    def _exchange(
        send: torch.Tensor | None, to: int | None, receive: torch.Tensor | None, source: int | None
    ) -> torch.Tensor | None:
        """Post a send and a receive together and wait for both; either may be absent."""
        works = []
        if send is not None and to is not None:
            works.append(dist.isend(send.detach().contiguous(), to))
        if receive is not None and source is not None:
            works.append(dist.irecv(receive, source))
        for work in works:
            work.wait()
        return receive if source is not None else None

    def _receive_activation(self, tokens: int) -> torch.Tensor | None:
        return self._exchange(None, None, self._buffer(tokens) if self.prev is not None else None, self.prev)

    # -- schedules ------------------------------------------------------------------------------------

    def forward(self, lengths: list[int], run: Callable[[int, torch.Tensor | None], object]) -> list:
        """Forward only: ``run(i, hidden)`` per micro-batch (hidden None on the first stage); returns the
        last stage's results, on every stage."""
        results = []
        for i, tokens in enumerate(lengths):
            out = run(i, self._receive_activation(tokens))
            if self.is_last:
                results.append(out)
            else:
                self._exchange(out, self.next, None, None)
        return self.from_last_stage(results)

    def train(
        self,
        lengths: list[int],
        run: Callable[[int, torch.Tensor | None], torch.Tensor],
        before_backward: Callable[[int], None],
    ) -> None:
        """1F1B: ``run(i, hidden)`` is micro-batch i's forward (its loss on the last stage, its output
        activation elsewhere); each backward follows the forwards in order, ``before_backward(i)`` first."""
        n = len(lengths)
        warmup = min(self.stages - self.stage - 1, n)
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

        def forward(i: int, hidden: torch.Tensor | None) -> torch.Tensor:
            if hidden is not None:
                hidden.requires_grad_(True)
            saved[i] = (hidden, run(i, hidden))
            return saved[i][1]

        def backward(i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
            before_backward(i)
            hidden, out = saved.pop(i)
            torch.autograd.backward(out, None if self.is_last else grad)
            return hidden.grad if hidden is not None else None

        def gradient_buffer(i: int) -> torch.Tensor | None:
            return self._buffer(lengths[i]) if self.next is not None else None

        for i in range(warmup):
            self._exchange(forward(i, self._receive_activation(lengths[i])), self.next, None, None)
        hidden = self._receive_activation(lengths[warmup]) if warmup < n else None
        for k, i in enumerate(range(warmup, n)):  # steady state: forward i, backward k
            out = forward(i, hidden)
            grad = self._exchange(None if self.is_last else out, self.next, gradient_buffer(k), self.next)
            input_grad = backward(k, grad)
            following = self._buffer(lengths[i + 1]) if i + 1 < n and self.prev is not None else None
            hidden = self._exchange(input_grad, self.prev, following, self.prev if following is not None else None)
        for k in range(n - warmup, n):  # cool-down: the backwards still in flight
            grad = self._exchange(None, None, gradient_buffer(k), self.next)
            self._exchange(backward(k, grad), self.prev, None, None)

    # -- making the stages look like one model --------------------------------------------------------

    def from_last_stage(self, value):
        """``value`` as the last stage has it, on every stage of this pipeline."""
        box = [value]
        dist.broadcast_object_list(box, src=self.ranks[-1], group=self.mesh.group("pp"))
        return box[0]

    @torch.no_grad()
    def sum_tied_gradients(self) -> None:
        """Sum the embedding's and the tied head's gradients over the first and last stage."""
        if self.embedding_group is None or self.stage not in (0, self.stages - 1):
            return
        grad = self.tied.grad if self.tied is not None and self.tied.grad is not None else None
        if grad is None:
            raise RuntimeError("the tied embedding has no gradient on this stage")
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.embedding_group)

    def rename_tied(self, optimizer_state: dict, *, to_embedding: bool) -> dict:
        """A flattened optimizer state dict (keys ``state.<name>.<field>`` and ``param_groups.<name>.
        <field>``, names under the engine's root) whose tied head goes by the embedding's name
        (``to_embedding``) or back: the first and last stage then save one entry, as one process does,
        and optimizer state moves between layouts with and without pipeline stages."""
        if self.tied is None or self.stage == 0:
            return optimizer_state
        head, embedding = ".model.lm_head.weight.", f".model.{self.tied_embedding_name}."
        old, new = (head, embedding) if to_embedding else (embedding, head)
        return {key.replace(old, new): value for key, value in optimizer_state.items()}

    @property
    def uncounted(self) -> torch.nn.Parameter | None:
        """The last stage's copy of a tied embedding: the first stage counts it in the gradient norm."""
        return self.tied if self.stage > 0 else None

    def gathered(
        self,
        header: list[tuple[str, torch.Size, torch.dtype]],
        stage_state: Callable[[bool], Iterator[tuple[str, torch.Tensor | None]]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stage's (name, full tensor) in stage order, on global rank 0 (nothing elsewhere).
        ``header`` names this stage's tensors with their full shapes; ``stage_state(keep)`` is the
        stage's collective iterator. Each stage's lead (dp = cp = tp = 0) sends its header, then its
        tensors one at a time, to rank 0. Collective: every rank iterates to the end."""
        lead = self.mesh.coords["dp"] == self.mesh.coords["cp"] == self.mesh.coords["tp"] == 0
        me = dist.get_rank()
        for stage, stage_lead in enumerate(self.ranks):
            if stage == self.stage:
                if lead and me != 0:
                    dist.send_object_list([header], dst=0)
                for name, tensor in stage_state(lead):
                    if me == 0:
                        yield name, tensor
                    elif lead:
                        dist.send(tensor, 0)
            elif me == 0:
                received = [None]
                dist.recv_object_list(received, src=stage_lead)
                for name, shape, dtype in received[0]:
                    tensor = torch.empty(shape, dtype=dtype, device=self.device)
                    dist.recv(tensor, stage_lead)
                    yield name, tensor
