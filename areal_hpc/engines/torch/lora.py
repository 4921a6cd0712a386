"""LoRA for the PyTorch-native engine (``actor.lora.rank`` > 0), with ``peft``: low-rank adapters
injected in place into the decoder's linear layers (``inject_adapter_in_model``: the model stays the
Hugging Face class the engine's forwards reach into), every other weight frozen, so only the adapters
have gradients and optimizer state.

What leaves the engine:
- the weight push and a Hugging Face save (``rollout_weights``, ``save(optimizer=False)``: the disk sync's
  folders, the run's ``model/``) carry MERGED weights, W + B·A·alpha/r, under the base model's names, so
  every rollout server (the embedded engine, SGLang, through disk or a broadcast) serves the adapted
  model with no adapter support of its own;
- a checkpoint (``save(optimizer=True)``) holds the adapters only, in ``peft``'s format
  (``adapter_model.safetensors`` + ``adapter_config.json``: ``PeftModel.from_pretrained(base, folder)``
  loads it), beside the optimizer and schedule state. Resuming loads them over the same base model
  (``model.path``, which the launcher keeps pointing at the run's starting model).

SGLang could also take the adapter itself (``/load_lora_adapter`` with ``lora_name`` and ``lora_path``,
on a server started with ``--enable-lora``, ``--max-lora-rank`` and ``--lora-target-modules``, each
request then naming its ``lora_path``): a few megabytes a push instead of the whole model. It is not
used: merged weights work on every server and every sync, and the embedded engine has no adapters.

Layouts: one process, or data-parallel replicas (replicate or FSDP2, ``actor.parallel.dp``/``fsdp``);
``areal_hpc.resolve`` refuses the rest (tensor, pipeline, context and expert parallelism, tree training) in
one line, and an ``actor.engine`` whose class does not say ``supports_lora`` (Megatron's).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from areal_hpc.config import LoRAConfig, RunConfig
from areal_hpc.engines.torch.parallelize import PackedForward, full_state, load_full_state
from areal_hpc.errors import UserError
from areal_hpc.extras import require

ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # where PeftModel keeps the Hugging Face model: the prefix of its saved names


def adaptable_layers(model: torch.nn.Module) -> list[str]:
    """Full names of the decoder's linear layers (what LoRA may adapt): the embeddings and the LM head,
    tied to them, are not among them."""
    return [
        f"{model.base_model_prefix}.layers.{name}"
        for name, module in model.base_model.layers.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Raise ``UserError`` unless each of ``targets`` names linear layers of the decoder (a layer's name,
    e.g. q_proj, or a dotted tail of it, e.g. self_attn.q_proj, as ``peft`` matches them)."""
    layers = adaptable_layers(model)
    if not targets:
        raise UserError(
            "actor.lora.target_modules is empty; name the decoder's linear layers to adapt, e.g. [q_proj, v_proj]"
        )
    unknown = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in layers)]
    if unknown:
        present = ", ".join(dict.fromkeys(name.rsplit(".", 1)[-1] for name in layers))
        raise UserError(
            f"actor.lora.target_modules: {', '.join(map(str, unknown))} not among the model's decoder "
            f"linear layers; it has {present}"
        )


def check_lora(cfg: RunConfig) -> None:
    """The launcher's check, before anything starts (after ``resolve``, which checks the layout): peft, and
    the target modules against the starting model's architecture (built on the meta device: no weights are
    read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from areal_hpc.models.tiny import preset_config

    require("peft")  # installed: the extra `lora`
    with torch.device("meta"):
        config = AutoConfig.from_pretrained(cfg.model.path) if cfg.model.path else preset_config(cfg.model.preset)
        model = AutoModelForCausalLM.from_config(config)
    check_targets(model, list(cfg.actor.lora.target_modules))


def peft_config(lora: LoRAConfig, base: str = ""):
    """``peft``'s ``LoraConfig`` of ``actor.lora`` (``base``: the base model's folder, recorded in the
    saved adapter's config)."""
    peft = require("peft")
    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        base_model_name_or_path=base or None,
    )


def add_adapters(model: torch.nn.Module, lora: LoRAConfig) -> None:
    """Inject ``lora``'s adapters into ``model`` in place (B = 0: the model computes what it did) and
    freeze everything else. Initialised from the global RNG (the caller seeds it)."""
    check_targets(model, list(lora.target_modules))
    peft = require("peft")
    peft.inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def keep_autocast_inputs(model: torch.nn.Module) -> None:
    """Under autocast, hand each adapter its input as it comes: peft casts it to the adapter's float32
    first, which autocast casts straight back (the quickstart's bfloat16 step took 1.44x full fine-tuning's
    time with those casts, 1.06x in float32)."""
    for module in model.modules():
        if hasattr(module, "lora_A"):
            module.cast_input_dtype_enabled = False


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merged(named: Iterator[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's (name, tensor) pairs from the adapted model's: each adapted layer's weight
    W + B·A·scale (computed in float32, handed out in W's dtype) under its own name, its bias too,
    the adapters themselves gone. Tensors come in the state dict's order: a layer's base weight and
    bias, then its A and B."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        layer, part, rest = _split(name)
        if part is None:
            yield name, tensor
            continue
        held[f"{layer}.{part}.{rest}"] = tensor
        if part == "lora_B":
            weight, a, b = (held.pop(f"{layer}.{key}.weight") for key in ("base_layer", "lora_A", "lora_B"))
            delta = (b.float() @ a.float()) * scale
            yield f"{layer}.weight", (weight.float() + delta).to(weight.dtype)
            if f"{layer}.base_layer.bias" in held:
                yield f"{layer}.bias", held.pop(f"{layer}.base_layer.bias")
    if held:
        raise RuntimeError(f"adapter tensors without their layer: {sorted(held)[:4]}")


def _split(name: str) -> tuple[str, str | None, str]:
    """(layer, "base_layer" | "lora_A" | "lora_B", "weight" | "bias") of an adapted layer's tensor;
    (name, None, "") for any other."""
    for part in ("base_layer", "lora_A", "lora_B"):
        marker = f".{part}."
        if marker in name:
            layer, rest = name.split(marker, 1)
            return layer, part, rest.removeprefix(f"{ADAPTER}.")
    return name, None, ""


def adapter_state(root: PackedForward, keep: bool) -> dict[str, torch.Tensor]:
    """The adapters' full tensors under ``peft``'s saved names, on the ranks that ``keep`` them (empty
    on the others). Collective: the whole state is gathered in order, the adapters kept."""
    return {
        PEFT_PREFIX + name.replace(f".{ADAPTER}.", "."): tensor
        for name, tensor in full_state(root, keep)
        if keep and is_adapter(name)
    }


def save_adapters(folder: Path, state: dict[str, torch.Tensor], lora: LoRAConfig, base: str) -> None:
    """``peft``'s adapter folder: the weights and the config (``PeftModel.from_pretrained`` reads it)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, folder / ADAPTER_WEIGHTS)
    peft_config(lora, base).save_pretrained(str(folder))


def load_adapters(root: PackedForward, folder: Path, lora: LoRAConfig) -> list[str]:
    """Copy a checkpoint's adapters into the model (each rank its shard); the adapter names it lacks.
    A folder without adapters, or with another rank or other target modules, is a ``UserError``."""
    from safetensors.torch import load_file

    if not (folder / ADAPTER_WEIGHTS).exists():
        raise UserError(
            f"{folder} holds no LoRA adapters ({ADAPTER_WEIGHTS}): it was saved without actor.lora; "
            "resume it with actor.lora.rank=0"
        )
    saved = json.loads((folder / ADAPTER_CONFIG).read_text())
    if saved["r"] != lora.rank or sorted(saved["target_modules"]) != sorted(lora.target_modules):
        raise UserError(
            f"{folder} holds adapters of rank {saved['r']} on {sorted(saved['target_modules'])}; this run "
            f"has actor.lora.rank={lora.rank}, target_modules={sorted(lora.target_modules)}"
        )
    state = {
        name.removeprefix(PEFT_PREFIX).replace(".weight", f".{ADAPTER}.weight"): tensor
        for name, tensor in load_file(folder / ADAPTER_WEIGHTS).items()
    }
    return load_full_state(root, state, only=is_adapter)
