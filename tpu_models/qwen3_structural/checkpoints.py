"""Qwen3 and Qwen3-structural checkpoints: the HF tables, MaxText's and Tunix's
layouts, and their registry entries.

Qwen3-structural is an HF Qwen3 checkpoint plus `structural_head.weight` [D, D]
(out, in) and `structural_head.bias` [D]. Plain Qwen3 (Qwen3ForCausalLM) is
served by tpu-inference's own model; it is here for export and LoRA merges.
"""

from tpu_models.loaders import tables
from tpu_models.loaders.maxtext import PROJECTIONS, MaxTextMapping, decoder_globals
from tpu_models.loaders.conversion_rules import Rule
from tpu_models.loaders.tunix import MLP, MLP_LORA, LoraRule, TunixMapping
from tpu_models.registry import Architecture

# --- HF ---------------------------------------------------------------------------

LAYER = {
    "model.layers.{i}.input_layernorm.weight": ("hidden",),
    **tables.ATTENTION,
    "model.layers.{i}.post_attention_layernorm.weight": ("hidden",),
    **tables.MLP,
}
STRUCTURAL_HEAD = {
    "structural_head.weight": ("hidden", "hidden"),  # [out, in], as torch.nn.Linear
    "structural_head.bias": ("hidden",),
}


def qwen3_table(config):
    return tables.decoder_table(config, LAYER)


def qwen3_structural_table(config):
    return tables.decoder_table(config, LAYER, extra=STRUCTURAL_HEAD)


# --- MaxText ------------------------------------------------------------------------

MAXTEXT_LAYER = {
    "input_layernorm.weight": Rule("pre_self_attention_layer_norm/scale"),
    "post_attention_layernorm.weight": Rule("post_self_attention_layer_norm/scale"),
    "self_attn.q_norm.weight": Rule("self_attention/query_norm/scale"),
    "self_attn.k_norm.weight": Rule("self_attention/key_norm/scale"),
    **PROJECTIONS,
}


def maxtext_config(architecture: str):
    def config(dims: dict) -> dict:
        """HF config.json: sizes from the tensors, the rest from MaxText's qwen3 configs."""
        layers = dims["num_hidden_layers"]
        return {**dims, "rms_norm_eps": 1e-6, "initializer_range": 0.02, "use_cache": True,
                "architectures": [architecture], "model_type": "qwen3", "hidden_act": "silu",
                "max_position_embeddings": 40960,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers,
                "layer_types": ["full_attention"] * layers, "attention_dropout": 0.0}
    return config


def maxtext_globals(hidden_size: int) -> dict[str, Rule]:
    return decoder_globals()


# --- Tunix --------------------------------------------------------------------------

TUNIX_WEIGHTS = {
    "model.embed_tokens.weight": Rule("embedder/input_embedding"),
    "model.norm.weight": Rule("final_norm/w"),
    "lm_head.weight": Rule("lm_head/w", "d v -> v d"),  # untied only
    "model.layers.{i}.input_layernorm.weight": Rule("layers/{i}/input_layernorm/w"),
    "model.layers.{i}.post_attention_layernorm.weight": Rule("layers/{i}/post_attention_layernorm/w"),
    "model.layers.{i}.self_attn.q_norm.weight": Rule("layers/{i}/attn/q_norm/w"),
    "model.layers.{i}.self_attn.k_norm.weight": Rule("layers/{i}/attn/k_norm/w"),
    "model.layers.{i}.self_attn.q_proj.weight": Rule("layers/{i}/attn/q_proj/w", "d n h -> (n h) d"),
    "model.layers.{i}.self_attn.k_proj.weight": Rule("layers/{i}/attn/k_proj/w", "d k h -> (k h) d"),
    "model.layers.{i}.self_attn.v_proj.weight": Rule("layers/{i}/attn/v_proj/w", "d k h -> (k h) d"),
    "model.layers.{i}.self_attn.o_proj.weight": Rule("layers/{i}/attn/o_proj/w", "n h d -> d (n h)"),
    **MLP,
}
TUNIX_LORA = {
    **{f"layers/{{i}}/attn/{p}_proj/w": [
        LoraRule(f"model.layers.{{i}}.self_attn.{p}_proj", "d r -> r d", "r n h -> (n h) r")]
       for p in "qkv"},
    "layers/{i}/attn/o_proj/w": [LoraRule("model.layers.{i}.self_attn.o_proj", "n h r -> r (n h)", "r d -> d r")],
    **MLP_LORA,
}
TUNIX = TunixMapping(markers=("/attn/q_proj/", ), weights=TUNIX_WEIGHTS, lora=TUNIX_LORA)

# --- registry entries -----------------------------------------------------------------

ARCHITECTURES = (
    Architecture(
        hf_name="Qwen3StructuralForCausalLM", export_name="qwen3-structural",
        hf_table=qwen3_structural_table,
        model="tpu_models.qwen3_structural.model:Qwen3StructuralForCausalLM", new_to_vllm=True,
        maxtext=MaxTextMapping(layer=MAXTEXT_LAYER, globals=maxtext_globals,
                               config=maxtext_config("Qwen3StructuralForCausalLM"),
                               dense_heads=("structural_head", )),
        extra_linear=("structural_head", )),
    Architecture(
        hf_name="Qwen3ForCausalLM", export_name="qwen3", hf_table=qwen3_table,
        maxtext=MaxTextMapping(layer=MAXTEXT_LAYER, globals=maxtext_globals,
                               config=maxtext_config("Qwen3ForCausalLM")),
        tunix=TUNIX),
)
