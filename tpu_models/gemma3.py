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

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from tpu_inference.layers.common.sharding import ShardingAxisName
from tpu_inference.layers.jax import JaxModule
from tpu_inference.layers.jax.embed import JaxEmbed
from tpu_inference.layers.jax.norm import JaxRmsNorm
from tpu_inference.models.jax.utils.weight_utils import LoadableWithIterator
from vllm.config import VllmConfig

from loaders.tables import gemma3_table
from tpu_models import runtime
from tpu_models.layers import Attention, AttentionConfig, GatedMLP, Rope, sharded, tied_logits

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int  # as in the checkpoint
    padded_vocab_size: int  # rounded up to a multiple of the vocab shards
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layers: tuple[AttentionConfig, ...]  # one per layer: local or global
    activation: str
    rms_norm_eps: float
    final_logit_softcapping: float | None
    dtype: Any  # activations and matmul inputs
    param_dtype: Any  # stored weights

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
        layers = tuple(
            AttentionConfig(
                hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
                num_kv_heads=hf.num_key_value_heads, head_dim=head_dim, rope=rope[kind],
                scale=hf.query_pre_attn_scalar**-0.5, bias=bool(hf.attention_bias),
                sliding_window=hf.sliding_window if kind == "sliding_attention" else None,
                soft_cap=hf.attn_logit_softcapping, head_shards=head_shards)
            for kind in layer_types)
        return cls(
            vocab_size=hf.vocab_size,
            padded_vocab_size=-(-hf.vocab_size // vocab_shards) * vocab_shards,
            hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers, layers=layers, activation=hf.hidden_activation,
            rms_norm_eps=hf.rms_norm_eps, final_logit_softcapping=hf.final_logit_softcapping,
            dtype=dtype, param_dtype=param_dtype or dtype)


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


def rms_norm(cfg: Gemma3Config, size: int, rngs, prefix: str) -> GemmaRmsNorm:
    return GemmaRmsNorm(size, epsilon=cfg.rms_norm_eps, dtype=cfg.dtype,
                        param_dtype=cfg.param_dtype,
                        scale_init=nnx.with_partitioning(nnx.initializers.zeros, (None, )),
                        rngs=rngs, prefix=prefix)


class Gemma3DecoderLayer(JaxModule):

    def __init__(self, cfg: Gemma3Config, attn: AttentionConfig, *, rngs, mesh,
                 engine: runtime.Engine, prefix: str):
        def norm(name, size=cfg.hidden_size):
            return rms_norm(cfg, size, rngs, f"{prefix}.{name}")

        self.input_layernorm = norm("input_layernorm")
        self.self_attn = Attention(
            attn, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs, mesh=mesh,
            backend=engine.attention_backend, kv_cache_dtype=engine.kv_cache_dtype,
            qk_norm=lambda p: rms_norm(cfg, attn.head_dim, rngs, p),
            quant_config=engine.quant_config, prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ACTIVATIONS[cfg.activation],
                            dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs,
                            quant_config=engine.quant_config, prefix=f"{prefix}.mlp")
        self.post_feedforward_layernorm = norm("post_feedforward_layernorm")

    def __call__(self, kv_cache, x, md):
        kv_cache, attn_out = self.self_attn(kv_cache, self.input_layernorm(x), md)
        x = x + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(x))
        return kv_cache, x + self.post_feedforward_layernorm(mlp_out)


class Gemma3Model(JaxModule):

    def __init__(self, cfg: Gemma3Config, *, rngs, mesh, engine: runtime.Engine):
        self.cfg = cfg
        self.embed_tokens = JaxEmbed(
            cfg.padded_vocab_size, cfg.hidden_size, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=sharded(ShardingAxisName.VOCAB, None), rngs=rngs,
            quant_config=engine.quant_config, prefix="model.embed_tokens")
        self.layers = nnx.List([
            Gemma3DecoderLayer(cfg, cfg.layers[i], rngs=rngs, mesh=mesh, engine=engine,
                               prefix=f"model.layers.{i}") for i in range(cfg.num_layers)])
        self.norm = rms_norm(cfg, cfg.hidden_size, rngs, "model.norm")

    def __call__(self, kv_caches, input_ids, md, inputs_embeds=None):
        if inputs_embeds is None:
            # HF rounds the scale to the model dtype before multiplying.
            scale = jnp.asarray(math.sqrt(self.cfg.hidden_size), self.cfg.dtype)
            inputs_embeds = self.embed_tokens(input_ids) * scale  # [T, D]
        x = inputs_embeds
        for i, layer in enumerate(self.layers):
            kv_caches[i], x = layer(kv_caches[i], x, md)
        return kv_caches, self.norm(x)


class Gemma3ForCausalLM(JaxModule, LoadableWithIterator):
    """tpu-inference flax_nnx model: built on the engine's mesh, fed its paged KV cache."""

    def __init__(self, vllm_config: VllmConfig, rng_key: jax.Array, mesh: Mesh):
        engine = runtime.Engine.from_vllm_config(vllm_config, mesh)
        self.cfg = Gemma3Config.from_hf_config(vllm_config.model_config.hf_text_config,
                                               dtype=engine.dtype,
                                               vocab_shards=engine.vocab_shards,
                                               head_shards=engine.head_shards)
        self.vllm_config = vllm_config
        self.model = Gemma3Model(self.cfg, rngs=nnx.Rngs(rng_key), mesh=mesh, engine=engine)

    def __call__(self, kv_caches, input_ids, attention_metadata, inputs_embeds=None,
                 _input_positions=None, _layer_name_to_kv_cache=None, _lora_metadata=None,
                 intermediate_tensors=None, is_first_rank=True, is_last_rank=True, *args):
        kv_caches, hidden = self.model(kv_caches, input_ids, attention_metadata, inputs_embeds)
        return kv_caches, hidden, [], None  # no auxiliary hidden states or expert ids

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        logits = tied_logits(self.model.embed_tokens, hidden)  # [T, V]
        if cap := self.cfg.final_logit_softcapping:
            logits = cap * jnp.tanh(logits / cap)
        return runtime.mask_padded_vocab(logits, self.cfg.vocab_size)

    def load_weights(self, weights=None):
        return runtime.load_checkpoint(self, gemma3_table(self.vllm_config.model_config.hf_text_config))
