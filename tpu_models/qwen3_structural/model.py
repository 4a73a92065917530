"""Qwen3-structural: Qwen3 with a structural head before the vocab projection.

The team's MaxText pre-training adds one Dense(D->D) + tanh between the final
norm and the vocab projection, to bias outputs toward JSON:

    h = model.norm(decoder(embed(ids)))
    logits = lm_head(tanh(structural_head(h)))      # or embed_tokens^T when tied

Everything else is HF Qwen3: GQA with per-head q/k RMSNorm, RoPE, SwiGLU MLP,
optional attention bias and sliding-window layers (`layer_types`). Checkpoints
are HF Qwen3 checkpoints plus `structural_head.weight` [D, D] (out, in) and
`structural_head.bias` [D]; checkpoints.py lists every tensor.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from tpu_inference.layers.jax.linear import JaxEinsum

from tpu_models.decoder import CausalLM, DecoderConfig, DecoderLayer
from tpu_models.layers import Rope, sharded


class Qwen3StructuralConfig(DecoderConfig):

    @classmethod
    def from_hf_config(cls, hf, *, dtype, param_dtype=None, vocab_shards: int = 1,
                       head_shards: int = 1):
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        rope = Rope.from_hf(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
                            or {"rope_theta": getattr(hf, "rope_theta", 10000.0)},
                            head_dim, hf.max_position_embeddings)
        layer_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
        layers = cls.attention_layers(hf, layer_types, head_dim=head_dim, rope=lambda kind: rope,
                                      scale=head_dim**-0.5, head_shards=head_shards)
        return cls(
            **cls.shared_fields(hf, dtype=dtype, param_dtype=param_dtype,
                                vocab_shards=vocab_shards),
            layers=layers, tie_word_embeddings=bool(hf.tie_word_embeddings),
            embedding_scale=None, final_logit_softcapping=None, activation=jax.nn.silu)


class Qwen3StructuralForCausalLM(CausalLM):
    config_class = Qwen3StructuralConfig
    layer_class = DecoderLayer  # pre-norm, RMSNorm x weight, q/k norms: the shared block

    def build_head(self, rngs, settings):
        D = self.cfg.hidden_size
        # Replicated, not split over the tensor axis: the vocab projection after it takes
        # the whole D on every chip. Split, its output made XLA gather it inside the vocab
        # projection's loop: 22% of a TP-8 decode step's logits program (tpu-models
        # compile, 0.6B on v6e-8), for a D x D weight (2 MB at 0.6B) each chip can hold.
        self.structural_head = JaxEinsum(
            "TD,DE->TE", (D, D), bias_shape=(D, ), rngs=rngs, dtype=self.cfg.dtype,
            param_dtype=self.cfg.param_dtype, kernel_init=sharded(None, None),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, (None, )),
            quant_config=settings.quant_config, prefix="structural_head")

    def head(self, hidden: jax.Array) -> jax.Array:
        return jnp.tanh(self.structural_head(hidden))  # [T, D]
