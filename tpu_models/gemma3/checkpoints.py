"""Gemma 3 (text) checkpoints: the HF table, MaxText's and Tunix's layouts, its registry entry.

HF Gemma3ForCausalLM, tied embeddings. MaxText stores its (1 + w) norm
weights with the +1 folded in and the embedding pre-multiplied by sqrt(D); we
undo both exactly (loaders/conversion_rules.py: fp64, one rounding). Tunix stores HF's
conventions, fusing k and v (kv_einsum), or q, k and v when the model has as
many KV heads as query heads (qkv_einsum).
"""

import math

from tpu_models.loaders import tables
from tpu_models.loaders.maxtext import PROJECTIONS, MaxTextMapping, decoder_globals
from tpu_models.loaders.conversion_rules import Rule
from tpu_models.loaders.tunix import MLP, MLP_LORA, LoraRule, TunixMapping
from tpu_models.registry import Architecture, Multimodal

# --- HF ---------------------------------------------------------------------------

LAYER = {
    "model.layers.{i}.input_layernorm.weight": ("hidden",),
    **tables.ATTENTION,
    "model.layers.{i}.post_attention_layernorm.weight": ("hidden",),
    "model.layers.{i}.pre_feedforward_layernorm.weight": ("hidden",),
    **tables.MLP,
    "model.layers.{i}.post_feedforward_layernorm.weight": ("hidden",),
}


def hf_table(config):
    table, _ = tables.decoder_table(config, LAYER, tied=True)
    return table, ()  # the vocab projection is the embedding: no lm_head tensor at all


# --- MaxText ------------------------------------------------------------------------

SCAN_PERIOD = 6  # scanned layers come in blocks of 6: 5 local, then 1 global

MAXTEXT_LAYER = {  # MaxText stores 1 + HF's norm weight
    "input_layernorm.weight": Rule("pre_self_attention_norm/scale", offset=-1.0),
    "post_attention_layernorm.weight": Rule("post_self_attention_norm/scale", offset=-1.0),
    "pre_feedforward_layernorm.weight": Rule("pre_ffw_norm/scale", offset=-1.0),
    "post_feedforward_layernorm.weight": Rule("post_ffw_norm/scale", offset=-1.0),
    "self_attn.q_norm.weight": Rule("self_attention/query_norm/scale", offset=-1.0),
    "self_attn.k_norm.weight": Rule("self_attention/key_norm/scale", offset=-1.0),
    **PROJECTIONS,
}


def maxtext_globals(hidden_size: int) -> dict[str, Rule]:
    return decoder_globals(embedding_scale=1 / math.sqrt(hidden_size), norm_offset=-1.0)


def maxtext_config(dims: dict) -> dict:
    """HF config.json: sizes from the tensors, the rest from MaxText's gemma3 configs
    (rope, windows, activation), which the checkpoint does not store."""
    layers = dims["num_hidden_layers"]
    config = {**dims, "rms_norm_eps": 1e-6, "initializer_range": 0.02, "use_cache": True,
              "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": dims["head_dim"],
              "sliding_window": 1024, "max_position_embeddings": 131072,
              "final_logit_softcapping": None, "attn_logit_softcapping": None,
              "layer_types": ["full_attention" if (i + 1) % SCAN_PERIOD == 0
                              else "sliding_attention" for i in range(layers)],
              "rope_parameters": {
                  "full_attention": {"rope_type": "linear", "factor": 8.0,
                                     "rope_theta": 1_000_000.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}
    config.pop("attention_bias")
    return config


MAXTEXT = MaxTextMapping(layer=MAXTEXT_LAYER, globals=maxtext_globals, config=maxtext_config,
                         scan_period=SCAN_PERIOD)

# --- Tunix --------------------------------------------------------------------------

TUNIX_WEIGHTS = {
    "model.embed_tokens.weight": Rule("embedder/input_embedding"),
    "model.norm.weight": Rule("final_norm/scale"),
    "model.layers.{i}.input_layernorm.weight": Rule("layers/{i}/pre_attention_norm/scale"),
    "model.layers.{i}.post_attention_layernorm.weight": Rule("layers/{i}/post_attention_norm/scale"),
    "model.layers.{i}.pre_feedforward_layernorm.weight": Rule("layers/{i}/pre_ffw_norm/scale"),
    "model.layers.{i}.post_feedforward_layernorm.weight": Rule("layers/{i}/post_ffw_norm/scale"),
    "model.layers.{i}.self_attn.q_norm.weight": Rule("layers/{i}/attn/_query_norm/scale"),
    "model.layers.{i}.self_attn.k_norm.weight": Rule("layers/{i}/attn/_key_norm/scale"),
    "model.layers.{i}.self_attn.q_proj.weight": Rule("layers/{i}/attn/q_einsum/w", "n d h -> (n h) d"),
    "model.layers.{i}.self_attn.k_proj.weight": Rule("layers/{i}/attn/kv_einsum/w", "k d h -> (k h) d", 0),
    "model.layers.{i}.self_attn.v_proj.weight": Rule("layers/{i}/attn/kv_einsum/w", "k d h -> (k h) d", 1),
    "model.layers.{i}.self_attn.o_proj.weight": Rule("layers/{i}/attn/attn_vec_einsum/w", "n h d -> d (n h)"),
    **MLP,
}
# As many KV heads as query heads: q, k and v fused.
TUNIX_WEIGHTS_MHA = {
    **TUNIX_WEIGHTS,
    "model.layers.{i}.self_attn.q_proj.weight": Rule("layers/{i}/attn/qkv_einsum/w", "n d h -> (n h) d", 0),
    "model.layers.{i}.self_attn.k_proj.weight": Rule("layers/{i}/attn/qkv_einsum/w", "n d h -> (n h) d", 1),
    "model.layers.{i}.self_attn.v_proj.weight": Rule("layers/{i}/attn/qkv_einsum/w", "n d h -> (n h) d", 2),
}
TUNIX_LORA = {
    "layers/{i}/attn/q_einsum/w": [LoraRule("model.layers.{i}.self_attn.q_proj", "d r -> r d", "r n h -> (n h) r")],
    "layers/{i}/attn/kv_einsum/w": [
        LoraRule(f"model.layers.{{i}}.self_attn.{p}_proj", "d r -> r d", "r k h -> (k h) r", j)
        for j, p in enumerate("kv")],
    "layers/{i}/attn/qkv_einsum/w": [
        LoraRule(f"model.layers.{{i}}.self_attn.{p}_proj", "d r -> r d", "r n h -> (n h) r", j)
        for j, p in enumerate("qkv")],
    "layers/{i}/attn/attn_vec_einsum/w": [
        LoraRule("model.layers.{i}.self_attn.o_proj", "n h r -> r (n h)", "r d -> d r")],
    **MLP_LORA,
}
TUNIX = TunixMapping(markers=("/attn/q_einsum/", "/attn/qkv_einsum/", "/attn/attn_vec_einsum/"),
                     weights=TUNIX_WEIGHTS, lora=TUNIX_LORA,
                     fused_markers=("/attn/qkv_einsum/", ), fused_weights=TUNIX_WEIGHTS_MHA)

# --- multimodal releases ----------------------------------------------------------------


def multimodal_text_config(source: str) -> dict:
    """The full text config of a multimodal Gemma 3 checkpoint, defaults filled in."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(source)
    if getattr(config, "architectures", [None])[0] != "Gemma3ForConditionalGeneration":
        raise ValueError(f"{source}: not a Gemma3ForConditionalGeneration checkpoint")
    text = config.text_config.to_dict()
    text["dtype"] = str(getattr(config, "dtype", None) or text.get("dtype") or "bfloat16").replace(
        "torch.", "")
    return text | {"model_type": "gemma3_text"}


MULTIMODAL = Multimodal(
    hf_name="Gemma3ForConditionalGeneration", export_name="gemma3-text",
    # as released, and as transformers >= 5 saves it
    text_prefixes=("language_model.model.", "model.language_model."),
    dropped_prefixes=("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                      "model.multi_modal_projector."),
    dropped=("lm_head.weight", "language_model.lm_head.weight"),  # tied to the embedding
    text_config=multimodal_text_config)

# --- registry entry -------------------------------------------------------------------

ARCHITECTURES = (
    Architecture(hf_name="Gemma3ForCausalLM", export_name="gemma3", hf_table=hf_table,
                 model="tpu_models.gemma3.model:Gemma3ForCausalLM", maxtext=MAXTEXT,
                 tunix=TUNIX, multimodal=MULTIMODAL),
)
