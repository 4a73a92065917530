"""The decoder our architectures share, and the calls tpu-inference's runner makes.

    ids -> embed_tokens (x embedding_scale) -> layers -> norm -> hidden     (__call__)
    hidden -> head -> lm_head, or embed_tokens^T when tied (-> soft cap)    (compute_logits)

A model file (tpu_models/<arch>/model.py) keeps only what is its own: its
config (`from_hf_config`), its norm, its layer when the block differs from the
pre-norm one here, and a `head` before the vocab projection. Modules carry HF
submodule names (`model.layers.{i}.self_attn.q_proj`), so tpu-inference's loader
maps checkpoint tensors onto them by name.

Shapes: T tokens, D hidden, V vocab.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from tpu_inference.layers.common.sharding import ShardingAxisName
from tpu_inference.layers.jax import JaxModule
from tpu_inference.layers.jax.embed import JaxEmbed
from tpu_inference.layers.jax.linear import JaxLmHead
from tpu_inference.layers.jax.norm import JaxRmsNorm
from tpu_inference.models.jax.utils.weight_utils import LoadableWithIterator
from vllm.config import VllmConfig

from tpu_models import registry, runtime
from tpu_models.lora_slots import AdapterSlots, LoraBatch
from tpu_models.layers import Attention, AttentionConfig, GatedMLP, Rope, sharded, tied_logits


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """What the shared decoder needs; each architecture's config extends it."""
    vocab_size: int  # as in the checkpoint
    padded_vocab_size: int  # rounded up to a multiple of the vocab shards
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layers: tuple[AttentionConfig, ...]  # one per layer (windows and RoPE may differ)
    rms_norm_eps: float
    tie_word_embeddings: bool
    embedding_scale: float | None  # multiplies embeddings (rounded to dtype first); None: 1
    final_logit_softcapping: float | None
    activation: Callable[[jax.Array], jax.Array]  # of the gated MLP
    dtype: Any  # activations and matmul inputs
    param_dtype: Any  # stored weights

    @staticmethod
    def shared_fields(hf, *, dtype, param_dtype, vocab_shards: int) -> dict:
        """The fields every HF decoder config spells the same way."""
        return dict(
            vocab_size=hf.vocab_size,
            padded_vocab_size=-(-hf.vocab_size // vocab_shards) * vocab_shards,
            hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers, rms_norm_eps=hf.rms_norm_eps,
            dtype=dtype, param_dtype=param_dtype or dtype)

    @staticmethod
    def attention_layers(hf, layer_types, *, head_dim: int, rope: Callable[[str], Rope],
                         scale: float, soft_cap: float | None = None,
                         head_shards: int = 1) -> tuple[AttentionConfig, ...]:
        """One AttentionConfig per layer; `layer_types` entries "sliding_attention"
        attend hf.sliding_window, `rope(kind)` is the layer type's RoPE."""
        return tuple(
            AttentionConfig(
                hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
                num_kv_heads=hf.num_key_value_heads, head_dim=head_dim, rope=rope(kind),
                scale=scale, bias=bool(getattr(hf, "attention_bias", False)),
                sliding_window=hf.sliding_window if kind == "sliding_attention" else None,
                soft_cap=soft_cap, head_shards=head_shards)
            for kind in layer_types)


class DecoderLayer(JaxModule):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); q/k norms per head."""

    norm_class: type[JaxRmsNorm] = JaxRmsNorm  # x * rsqrt(mean(x^2) + eps) * weight
    norm_init: Callable = nnx.initializers.ones

    @classmethod
    def norm(cls, cfg: DecoderConfig, size: int, rngs: nnx.Rngs, prefix: str) -> JaxRmsNorm:
        return cls.norm_class(size, epsilon=cfg.rms_norm_eps, dtype=cfg.dtype,
                              param_dtype=cfg.param_dtype,
                              scale_init=nnx.with_partitioning(cls.norm_init, (None, )),
                              rngs=rngs, prefix=prefix)

    def __init__(self, cfg: DecoderConfig, attn: AttentionConfig, *, rngs: nnx.Rngs, mesh: Mesh,
                 settings: runtime.EngineSettings, prefix: str):
        self.input_layernorm = self.norm(cfg, cfg.hidden_size, rngs, f"{prefix}.input_layernorm")
        self.self_attn = Attention(
            attn, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs, mesh=mesh,
            backend=settings.attention_backend, kv_cache_dtype=settings.kv_cache_dtype,
            qk_norm=lambda p: self.norm(cfg, attn.head_dim, rngs, p),
            quant_config=settings.quant_config, prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = self.norm(cfg, cfg.hidden_size, rngs,
                                                  f"{prefix}.post_attention_layernorm")
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.activation,
                            dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs,
                            quant_config=settings.quant_config, prefix=f"{prefix}.mlp")

    def __call__(self, kv_cache, x, md, lora=None):
        kv_cache, attn_out = self.self_attn(kv_cache, self.input_layernorm(x), md, lora)
        x = x + attn_out
        return kv_cache, x + self.mlp(self.post_attention_layernorm(x), lora)


class Decoder(JaxModule):
    """HF's `model.`: embed_tokens, layers, norm."""

    def __init__(self, cfg: DecoderConfig, layer: type[DecoderLayer], *, rngs: nnx.Rngs,
                 mesh: Mesh, settings: runtime.EngineSettings):
        self.cfg = cfg
        self.embed_tokens = JaxEmbed(
            cfg.padded_vocab_size, cfg.hidden_size, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            embedding_init=sharded(ShardingAxisName.VOCAB, None), rngs=rngs,
            quant_config=settings.quant_config, prefix="model.embed_tokens")
        self.layers = nnx.List([
            layer(cfg, cfg.layers[i], rngs=rngs, mesh=mesh, settings=settings,
                  prefix=f"model.layers.{i}") for i in range(cfg.num_layers)])
        self.norm = layer.norm(cfg, cfg.hidden_size, rngs, "model.norm")

    def __call__(self, kv_caches, input_ids, md, inputs_embeds=None, cache_index=None,
                 aux_layers: tuple[int, ...] = (), lora: LoraBatch | None = None):
        """`md`: one AttentionMetadata, or the runner's {"layer.{i}": metadata}
        when the KV cache has groups (each with its block table); `cache_index`:
        {"layer.{i}": index into kv_caches}, shared by layers of different
        groups (default: layer i owns kv_caches[i]); `lora`: the step's adapters
        (tpu_models.lora_slots), None without --enable-lora. Returns (kv_caches,
        hidden, the input [T, D] of each layer in `aux_layers`)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # [T, D]
            if self.cfg.embedding_scale is not None:
                # HF rounds the scale to the model dtype before multiplying.
                inputs_embeds = inputs_embeds * jnp.asarray(self.cfg.embedding_scale,
                                                            self.cfg.dtype)
        x = inputs_embeds
        aux = []
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(x)
            name = f"layer.{i}"
            c = cache_index.get(name, i) if cache_index else i
            kv_caches[c], x = layer(kv_caches[c], x, md[name] if isinstance(md, dict) else md, lora)
        return kv_caches, self.norm(x), aux


def eagle3_aux_layers(vllm_config: VllmConfig, num_layers: int) -> tuple[int, ...]:
    """The layers whose input hidden states an EAGLE-3 draft reads, as vLLM
    picks them: the draft config's `eagle_aux_hidden_state_layer_ids` (or its
    `eagle_config`'s), else (2, L // 2, L - 3). Empty without an EAGLE-3 draft:
    the step then computes and returns nothing extra."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "eagle3":
        return ()
    draft = spec.draft_model_config.hf_config
    field = "eagle_aux_hidden_state_layer_ids"
    ids = getattr(draft, field, None) or (getattr(draft, "eagle_config", None) or {}).get(field)
    if not ids:
        ids, field = (2, num_layers // 2, num_layers - 3), "vLLM's default"
    if any(not 0 <= i < num_layers for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(
            f"EAGLE-3 draft {spec.draft_model_config.model}: auxiliary hidden-state layers "
            f"{list(ids)} ({field}) must be distinct layers of the target's {num_layers}; "
            f"set {field!r} in the draft's config.json")
    return tuple(ids)


class CausalLM(JaxModule, LoadableWithIterator):
    """A tpu-inference flax_nnx model: built on the engine's mesh, fed its paged KV cache.

    Subclasses are named as their HF architecture (their registry entry) and set
    `config_class` and `layer_class`; `head` transforms hidden states before the
    vocab projection (identity here).
    """

    config_class: type[DecoderConfig]
    layer_class: type[DecoderLayer]
    WeightLoader = runtime.StreamedWeights  # takes vLLM's weight stream (object storage)

    def __init__(self, vllm_config: VllmConfig, rng_key: jax.Array, mesh: Mesh):
        runtime.check_before_build(vllm_config, type(self))  # what the seam refuses here
        settings = runtime.EngineSettings.from_vllm_config(vllm_config, mesh)
        self.vllm_config = vllm_config
        self.cfg = cfg = self.config_class.from_hf_config(
            vllm_config.model_config.hf_text_config, dtype=settings.dtype,
            vocab_shards=settings.vocab_shards, head_shards=settings.head_shards)
        self.aux_layers = eagle3_aux_layers(vllm_config, cfg.num_layers)
        rngs = nnx.Rngs(rng_key)
        self.model = Decoder(cfg, self.layer_class, rngs=rngs, mesh=mesh, settings=settings)
        self.build_head(rngs, settings)
        if not cfg.tie_word_embeddings:
            self.lm_head = JaxLmHead(cfg.hidden_size, cfg.padded_vocab_size, rngs=rngs,
                                     dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                                     kernel_init=sharded(None, ShardingAxisName.VOCAB))

    @classmethod
    def sliding_windows(cls, hf_config) -> list[int | None]:
        """Each layer's sliding window (None: full attention), for the KV-cache
        specs the engine groups layers by (tpu_models.kv_cache)."""
        cfg = cls.config_class.from_hf_config(hf_config, dtype=jnp.float32)
        return [layer.sliding_window for layer in cfg.layers]

    def build_head(self, rngs: nnx.Rngs, settings: runtime.EngineSettings) -> None:
        """Modules of `head`, if any."""

    def head(self, hidden: jax.Array) -> jax.Array:
        return hidden

    def __call__(self, kv_caches, input_ids, attention_metadata, inputs_embeds=None,
                 _input_positions=None, layer_name_to_kv_cache=None,
                 lora: LoraBatch | None = None, intermediate_tensors=None, is_first_rank=True,
                 is_last_rank=True, *args):
        kv_caches, hidden, aux = self.model(kv_caches, input_ids, attention_metadata,
                                            inputs_embeds, dict(layer_name_to_kv_cache or ()),
                                            self.aux_layers, lora)
        return kv_caches, hidden, aux, None  # no expert ids

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        x = self.head(hidden)  # [T, D]
        if self.cfg.tie_word_embeddings:
            logits = tied_logits(self.model.embed_tokens, x)  # [T, V]
        else:
            logits = self.lm_head(x)  # [T, V]
        if cap := self.cfg.final_logit_softcapping:
            logits = cap * jnp.tanh(logits / cap)
        return runtime.mask_padded_vocab(logits, self.cfg.vocab_size)

    @classmethod
    def checkpoint_table(cls, hf_config) -> dict[str, tuple[int, ...]]:
        """HF tensor name -> shape, of this architecture's checkpoints (its registry entry)."""
        table, _ = registry.by_hf_name(cls.__name__).hf_table(hf_config)
        return table

    def adapter_slots(self, mesh: Mesh) -> AdapterSlots:
        """The engine's LoRA manager under --enable-lora (tpu_models.lora_slots), checking
        adapters against this architecture's checkpoint table."""
        table = self.checkpoint_table(self.vllm_config.model_config.hf_text_config)
        return AdapterSlots(self, self.vllm_config.lora_config, mesh, table, self.cfg.dtype)

    def load_weights(self, weights=None):
        architecture = registry.by_hf_name(type(self).__name__)
        table, optional = architecture.hf_table(self.vllm_config.model_config.hf_text_config)
        return runtime.load_checkpoint(self, table, optional=optional,
                                       extra_linear=architecture.extra_linear, weights=weights)
