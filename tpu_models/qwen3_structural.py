"""Qwen3-structural: Qwen3 with a structural head before the vocab projection.

The team's MaxText pre-training adds one Dense(D->D) + tanh between the final
norm and the vocab projection, to bias outputs toward JSON:

    h = model.norm(decoder(embed(ids)))
    logits = lm_head(tanh(structural_head(h)))      # or embed_tokens^T when tied

Everything else is HF Qwen3: GQA with per-head q/k RMSNorm, RoPE, SwiGLU MLP,
optional attention bias and sliding-window layers (`layer_types`). Checkpoints
are HF Qwen3 checkpoints plus `structural_head.weight` [D, D] (out, in) and
`structural_head.bias` [D]; loaders/tables.py lists every tensor.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from tpu_inference.layers.common.sharding import ShardingAxisName
from tpu_inference.layers.jax import JaxModule
from tpu_inference.layers.jax.embed import JaxEmbed
from tpu_inference.layers.jax.linear import JaxEinsum, JaxLmHead
from tpu_inference.layers.jax.norm import JaxRmsNorm
from tpu_inference.models.jax.utils.weight_utils import LoadableWithIterator
from vllm.config import VllmConfig

from loaders.tables import qwen3_table
from tpu_models import runtime
from tpu_models.layers import Attention, AttentionConfig, GatedMLP, Rope, sharded, tied_logits


@dataclasses.dataclass(frozen=True)
class Qwen3StructuralConfig:
    vocab_size: int  # as in the checkpoint
    padded_vocab_size: int  # rounded up to a multiple of the vocab shards
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layers: tuple[AttentionConfig, ...]  # one per layer: window differs by layer_types
    rms_norm_eps: float
    tie_word_embeddings: bool
    dtype: Any  # activations and matmul inputs
    param_dtype: Any  # stored weights

    @classmethod
    def from_hf_config(cls, hf, *, dtype, param_dtype=None, vocab_shards: int = 1,
                       head_shards: int = 1):
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        rope = Rope.from_hf(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
                            or {"rope_theta": getattr(hf, "rope_theta", 10000.0)},
                            head_dim, hf.max_position_embeddings)
        layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
        layers = tuple(
            AttentionConfig(
                hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
                num_kv_heads=hf.num_key_value_heads, head_dim=head_dim, rope=rope,
                scale=head_dim**-0.5, bias=bool(getattr(hf, "attention_bias", False)),
                sliding_window=hf.sliding_window if kind == "sliding_attention" else None,
                head_shards=head_shards)
            for kind in layer_types)
        return cls(
            vocab_size=hf.vocab_size,
            padded_vocab_size=-(-hf.vocab_size // vocab_shards) * vocab_shards,
            hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers, layers=layers, rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(hf.tie_word_embeddings), dtype=dtype,
            param_dtype=param_dtype or dtype)


def rms_norm(cfg: Qwen3StructuralConfig, size: int, rngs, prefix: str) -> JaxRmsNorm:
    return JaxRmsNorm(size, epsilon=cfg.rms_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                      scale_init=nnx.with_partitioning(nnx.initializers.ones, (None, )),
                      rngs=rngs, prefix=prefix)


class Qwen3DecoderLayer(JaxModule):

    def __init__(self, cfg: Qwen3StructuralConfig, attn: AttentionConfig, *, rngs, mesh,
                 engine: runtime.Engine, prefix: str):
        self.input_layernorm = rms_norm(cfg, cfg.hidden_size, rngs, f"{prefix}.input_layernorm")
        self.self_attn = Attention(
            attn, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs, mesh=mesh,
            backend=engine.attention_backend, kv_cache_dtype=engine.kv_cache_dtype,
            qk_norm=lambda p: rms_norm(cfg, attn.head_dim, rngs, p),
            quant_config=engine.quant_config, prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = rms_norm(cfg, cfg.hidden_size, rngs,
                                                 f"{prefix}.post_attention_layernorm")
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, jax.nn.silu, dtype=cfg.dtype,
                            param_dtype=cfg.param_dtype, rngs=rngs,
                            quant_config=engine.quant_config, prefix=f"{prefix}.mlp")

    def __call__(self, kv_cache, x, md):
        kv_cache, attn_out = self.self_attn(kv_cache, self.input_layernorm(x), md)
        x = x + attn_out
        return kv_cache, x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(JaxModule):

    def __init__(self, cfg: Qwen3StructuralConfig, *, rngs, mesh, engine: runtime.Engine):
        self.embed_tokens = JaxEmbed(
            cfg.padded_vocab_size, cfg.hidden_size, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=sharded(ShardingAxisName.VOCAB, None), rngs=rngs,
            quant_config=engine.quant_config, prefix="model.embed_tokens")
        self.layers = nnx.List([
            Qwen3DecoderLayer(cfg, cfg.layers[i], rngs=rngs, mesh=mesh, engine=engine,
                              prefix=f"model.layers.{i}") for i in range(cfg.num_layers)])
        self.norm = rms_norm(cfg, cfg.hidden_size, rngs, "model.norm")

    def __call__(self, kv_caches, input_ids, md, inputs_embeds=None):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, D]
        for i, layer in enumerate(self.layers):
            kv_caches[i], x = layer(kv_caches[i], x, md)
        return kv_caches, self.norm(x)


class Qwen3StructuralForCausalLM(JaxModule, LoadableWithIterator):
    """tpu-inference flax_nnx model: built on the engine's mesh, fed its paged KV cache."""

    def __init__(self, vllm_config: VllmConfig, rng_key: jax.Array, mesh: Mesh):
        engine = runtime.Engine.from_vllm_config(vllm_config, mesh)
        hf = vllm_config.model_config.hf_config
        self.cfg = cfg = Qwen3StructuralConfig.from_hf_config(
            hf, dtype=engine.dtype, vocab_shards=engine.vocab_shards,
            head_shards=engine.head_shards)
        self.vllm_config = vllm_config
        rngs = nnx.Rngs(rng_key)
        self.model = Qwen3Model(cfg, rngs=rngs, mesh=mesh, engine=engine)
        D = cfg.hidden_size
        self.structural_head = JaxEinsum(
            "TD,DE->TE", (D, D), bias_shape=(D, ), rngs=rngs, dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=sharded(None, ShardingAxisName.MLP_TENSOR),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, (ShardingAxisName.MLP_TENSOR, )),
            quant_config=engine.quant_config, prefix="structural_head")
        if not cfg.tie_word_embeddings:
            self.lm_head = JaxLmHead(D, cfg.padded_vocab_size, rngs=rngs, dtype=cfg.dtype,
                                     param_dtype=cfg.param_dtype,
                                     kernel_init=sharded(None, ShardingAxisName.VOCAB))

    def __call__(self, kv_caches, input_ids, attention_metadata, inputs_embeds=None,
                 _input_positions=None, _layer_name_to_kv_cache=None, _lora_metadata=None,
                 intermediate_tensors=None, is_first_rank=True, is_last_rank=True, *args):
        kv_caches, hidden = self.model(kv_caches, input_ids, attention_metadata, inputs_embeds)
        return kv_caches, hidden, [], None  # no auxiliary hidden states or expert ids

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        x = jnp.tanh(self.structural_head(hidden))  # [T, D]
        if self.cfg.tie_word_embeddings:
            logits = tied_logits(self.model.embed_tokens, x)  # [T, V]
        else:
            logits = self.lm_head(x)  # [T, V]
        return runtime.mask_padded_vocab(logits, self.cfg.vocab_size)

    def load_weights(self, weights=None):
        hf = self.vllm_config.model_config.hf_config
        return runtime.load_checkpoint(
            self, qwen3_table(hf, structural=True),
            optional=["lm_head.weight"] if hf.tie_word_embeddings else [])
