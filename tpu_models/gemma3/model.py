"""Gemma 3 (text): HF `Gemma3ForCausalLM`, model_type "gemma3_text".

How it departs from a Llama-style decoder:
- local and global layers (`layer_types`, else every `sliding_window_pattern`-th
  layer is global): local layers attend a sliding window and rotate with
  their own RoPE base (`rope_parameters["sliding_attention"]`, formerly
  `rope_local_base_freq`), global ones with `rope_theta` and `rope_scaling`;
- attention scores scale by `query_pre_attn_scalar ** -0.5`, with RMSNorm on
  q and k, and are soft-capped when `attn_logit_softcapping` is set (released
  Gemma 3 configs leave it unset; transformers 5 and vLLM's PyTorch Gemma 3
  ignore it even when set, we apply it as Gemma 2 does);
- RMSNorm multiplies by (1 + weight), in fp32; norms before *and* after both
  attention and MLP;
- embeddings scale by sqrt(hidden_size), rounded to the model dtype;
- `gelu_pytorch_tanh` gated MLP; tied embeddings; optional
  `final_logit_softcapping`.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from tpu_inference.layers.jax.norm import JaxRmsNorm

from tpu_models.decoder import CausalLM, DecoderConfig, DecoderLayer
from tpu_models.layers import Rope

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


class Gemma3Config(DecoderConfig):

    @classmethod
    def from_hf_config(cls, hf, *, dtype, param_dtype=None, vocab_shards: int = 1,
                       head_shards: int = 1):
        if hf.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"Gemma 3: hidden_activation {hf.hidden_activation!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
        head_dim = hf.head_dim
        layer_types = getattr(hf, "layer_types", None) or [
            "sliding_attention" if (i + 1) % getattr(hf, "sliding_window_pattern", 6) else
            "full_attention" for i in range(hf.num_hidden_layers)]
        rope = {kind: Rope.from_hf(params, head_dim, hf.max_position_embeddings)
                for kind, params in _rope_parameters(hf).items()}
        layers = cls.attention_layers(
            hf, layer_types, head_dim=head_dim, rope=rope.__getitem__,
            scale=hf.query_pre_attn_scalar**-0.5, soft_cap=hf.attn_logit_softcapping,
            head_shards=head_shards)
        return cls(
            **cls.shared_fields(hf, dtype=dtype, param_dtype=param_dtype,
                                vocab_shards=vocab_shards),
            layers=layers, tie_word_embeddings=True, embedding_scale=math.sqrt(hf.hidden_size),
            final_logit_softcapping=hf.final_logit_softcapping,
            activation=ACTIVATIONS[hf.hidden_activation])


def _rope_parameters(hf) -> dict[str, dict]:
    """Per layer type RoPE parameters, from new-style or legacy config fields."""
    params = getattr(hf, "rope_parameters", None) or {}
    if "full_attention" in params:
        return {"full_attention": params["full_attention"],
                "sliding_attention": params["sliding_attention"]}
    scaling = dict(getattr(hf, "rope_scaling", None) or {})
    return {"full_attention": {**scaling, "rope_theta": getattr(hf, "rope_theta", 1e6)},
            "sliding_attention": {"rope_theta": getattr(hf, "rope_local_base_freq", 1e4)}}


class GemmaRmsNorm(JaxRmsNorm):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), in fp32; weight starts at 0."""

    def __call__(self, x: jax.Array, mask=None) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class Gemma3DecoderLayer(DecoderLayer):
    """The pre-norm block, plus norms after attention and after the MLP."""

    norm_class = GemmaRmsNorm
    norm_init = nnx.initializers.zeros

    def __init__(self, cfg, attn, *, rngs, mesh, settings, prefix):
        super().__init__(cfg, attn, rngs=rngs, mesh=mesh, settings=settings, prefix=prefix)
        self.pre_feedforward_layernorm = self.norm(cfg, cfg.hidden_size, rngs,
                                                   f"{prefix}.pre_feedforward_layernorm")
        self.post_feedforward_layernorm = self.norm(cfg, cfg.hidden_size, rngs,
                                                    f"{prefix}.post_feedforward_layernorm")

    def __call__(self, kv_cache, x, md, lora=None):
        kv_cache, attn_out = self.self_attn(kv_cache, self.input_layernorm(x), md, lora)
        x = x + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x), lora)
        return kv_cache, x + self.post_feedforward_layernorm(mlp_out)


class Gemma3ForCausalLM(CausalLM):
    config_class = Gemma3Config
    layer_class = Gemma3DecoderLayer
