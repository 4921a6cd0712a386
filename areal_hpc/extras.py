"""Optional extras (megatron, sglang, te, npu, mpi, agents, lora): imported lazily, with an install hint when absent."""

import importlib

# module name -> the pip extra that provides it
EXTRAS = {
    "megatron.core": "megatron",
    "sglang": "sglang",
    "transformer_engine": "te",
    "torch_npu": "npu",
    "mpi4py": "mpi",
    "agents": "agents",  # the OpenAI Agents SDK (package openai-agents)
    "peft": "lora",  # LoRA adapters (actor.lora)
}


def require(module: str):
    """Import an optional dependency or raise a UserError saying which extra installs it."""
    from areal_hpc.errors import UserError

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS.get(module, module)
        raise UserError(
            f"optional dependency '{module}' is not installed ({exc}); "
            f"install it with: pip install 'areal-hpc[{extra}]'"
        ) from None
