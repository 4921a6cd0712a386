"""Scaled-down replicas of released models: each keeps its original's structure (attention kinds and their
RoPE, norms, head and key/value head ratios, tied head, activation) at a width and depth a CPU trains in
minutes, so every family's code path runs end to end without a download.

``areal-hpc init-model --preset qwen3-replica`` (or ``model.preset=...``) builds one with the tokenizer's
vocabulary and a context of 1024 tokens (``models.tiny.init_model``); the original's vocabulary size is not
kept, and lengths tied to the context (a sliding window, RoPE scaling's original context) shrink with it, so
the tasks' sequences of tens of tokens cross them as long ones cross the original's. Each shape below is the
``transformers`` config's fields less the vocabulary, special tokens and context, which ``init_model`` adds.
"""

from __future__ import annotations

REPLICAS: dict[str, dict] = {
    # Qwen3-1.7B: 28 layers, hidden 2048 = 16 heads x 128, 8 key/value heads, MLP 3x, q/k RMSNorm per head,
    # RoPE base 1e6, tied head.
    "qwen3-replica": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
    ),
    # Llama-3.2-1B: 16 layers, hidden 2048 = 32 heads x 64, 8 key/value heads, MLP 4x, RoPE base 5e5 scaled as
    # "llama3" (factor 32 beyond the original 8192 tokens of its 131072: 64 of 1024 here), tied head.
    "llama3-replica": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=512,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
    ),
    # gemma-3-1b: 26 layers, five sliding-window (512 of its 32768 tokens: 16 of 1024 here; RoPE base 1e4) to one
    # global (RoPE base 1e6), hidden 1152, 4 heads x 256 and one key/value head, queries scaled by
    # query_pre_attn_scalar^-1/2 (= head dim), MLP 6x with tanh-approximated GELU, (1 + weight) RMSNorms around
    # attention and MLP and on q/k, embeddings scaled by sqrt(hidden), tied head, no logit softcapping.
    "gemma3-replica": dict(
        hidden_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        intermediate_size=768,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        sliding_window=16,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=True,
    ),
}

# Each replica's tokenizer carries its original's chat template and special tokens (``models.chat_families``).
REPLICA_TEMPLATES = {"qwen3-replica": "qwen3", "llama3-replica": "llama3", "gemma3-replica": "gemma3"}
