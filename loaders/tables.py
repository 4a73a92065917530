"""Name/shape tables of the HF checkpoint formats we serve.

One literal table per format, `{i}` standing for the layer index and symbolic
dimensions resolved from config.json. The loader checks a checkpoint against
its table before reading a weight; the exporters write exactly these names.
"""

from collections.abc import Mapping
from typing import Any

# Shared by Qwen3 and Gemma 3 decoders: HF Linear weights are [out, in].
_ATTENTION = {
    "model.layers.{i}.self_attn.q_proj.weight": ("q_size", "hidden"),
    "model.layers.{i}.self_attn.k_proj.weight": ("kv_size", "hidden"),
    "model.layers.{i}.self_attn.v_proj.weight": ("kv_size", "hidden"),
    "model.layers.{i}.self_attn.o_proj.weight": ("hidden", "q_size"),
    "model.layers.{i}.self_attn.q_norm.weight": ("head_dim",),
    "model.layers.{i}.self_attn.k_norm.weight": ("head_dim",),
}
_ATTENTION_BIAS = {
    "model.layers.{i}.self_attn.q_proj.bias": ("q_size",),
    "model.layers.{i}.self_attn.k_proj.bias": ("kv_size",),
    "model.layers.{i}.self_attn.v_proj.bias": ("kv_size",),
    "model.layers.{i}.self_attn.o_proj.bias": ("hidden",),
}
_MLP = {
    "model.layers.{i}.mlp.gate_proj.weight": ("intermediate", "hidden"),
    "model.layers.{i}.mlp.up_proj.weight": ("intermediate", "hidden"),
    "model.layers.{i}.mlp.down_proj.weight": ("hidden", "intermediate"),
}

QWEN3_LAYER = {
    "model.layers.{i}.input_layernorm.weight": ("hidden",),
    **_ATTENTION,
    "model.layers.{i}.post_attention_layernorm.weight": ("hidden",),
    **_MLP,
}
QWEN3 = {
    "model.embed_tokens.weight": ("vocab", "hidden"),
    "model.norm.weight": ("hidden",),
}
UNTIED_HEAD = {"lm_head.weight": ("vocab", "hidden")}
STRUCTURAL_HEAD = {
    "structural_head.weight": ("hidden", "hidden"),  # [out, in], as torch.nn.Linear
    "structural_head.bias": ("hidden",),
}

GEMMA3_LAYER = {
    "model.layers.{i}.input_layernorm.weight": ("hidden",),
    **_ATTENTION,
    "model.layers.{i}.post_attention_layernorm.weight": ("hidden",),
    "model.layers.{i}.pre_feedforward_layernorm.weight": ("hidden",),
    **_MLP,
    "model.layers.{i}.post_feedforward_layernorm.weight": ("hidden",),
}
GEMMA3 = QWEN3

# LoRA can target these projections; the merge looks them up here.
PROJECTIONS = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}


def dims(config: Any) -> dict[str, int]:
    """Symbolic dimensions of a decoder config (HF config object or config.json dict)."""
    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    heads, hidden = get("num_attention_heads"), get("hidden_size")
    head_dim = get("head_dim") or hidden // heads
    return {
        "vocab": get("vocab_size"),
        "hidden": hidden,
        "intermediate": get("intermediate_size"),
        "head_dim": head_dim,
        "q_size": heads * head_dim,
        "kv_size": get("num_key_value_heads", heads) * head_dim,
    }


def resolve(table: Mapping[str, tuple], num_layers: int | None, sizes: Mapping[str, int]
            ) -> dict[str, tuple[int, ...]]:
    """Expands `{i}` over layers and symbolic dimensions into concrete shapes."""
    out = {}
    for name, shape in table.items():
        concrete = tuple(sizes[d] for d in shape)
        if "{i}" in name:
            out.update({name.format(i=i): concrete for i in range(num_layers)})
        else:
            out[name] = concrete
    return out


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)


def qwen3_table(config: Any, *, structural: bool) -> dict[str, tuple[int, ...]]:
    """Tensors of a Qwen3 (structural=False) or Qwen3-structural checkpoint."""
    table = {**QWEN3, **QWEN3_LAYER}
    if _get(config, "attention_bias", False):
        table.update(_ATTENTION_BIAS)
    if not _get(config, "tie_word_embeddings", False):
        table.update(UNTIED_HEAD)
    if structural:
        table.update(STRUCTURAL_HEAD)
    return resolve(table, _get(config, "num_hidden_layers"), dims(config))


def gemma3_table(config: Any) -> dict[str, tuple[int, ...]]:
    """Tensors of a Gemma 3 text checkpoint (always tied embeddings)."""
    table = {**GEMMA3, **GEMMA3_LAYER}
    if _get(config, "attention_bias", False):
        table.update(_ATTENTION_BIAS)
    return resolve(table, _get(config, "num_hidden_layers"), dims(config))


def table_for(config: Any) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """(table, optional tensor names) for a config.json of an architecture we serve."""
    arch = (_get(config, "architectures") or [None])[0]
    tied = _get(config, "tie_word_embeddings", False)
    optional = ["lm_head.weight"] if tied else []
    if arch == "Qwen3StructuralForCausalLM":
        return qwen3_table(config, structural=True), optional
    if arch == "Qwen3ForCausalLM":
        return qwen3_table(config, structural=False), optional
    if arch == "Gemma3ForCausalLM":
        return gemma3_table(config), []
    raise ValueError(f"architecture {arch!r} has no checkpoint table (known: "
                     "Qwen3StructuralForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM)")
