"""Layers our models share: rotary embeddings, the gated MLP, and attention
over tpu-inference's paged KV cache.

Weights are tpu-inference building blocks (JaxEinsum, JaxRmsNorm, ...) named
as the HF submodules, so tpu-inference's loader maps HF tensors by name and its
quantization methods apply unchanged. Logical sharding axes come from
tpu-inference's ShardingAxisName, which maps them onto its mesh.

Shapes: T tokens, D hidden, N query heads, K kv heads, H head_dim, F mlp width.
"""

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from tpu_inference.layers.common.attention_backend import AttentionBackend
from tpu_inference.layers.common.attention_interface import attention
from tpu_inference.layers.common.attention_metadata import AttentionMetadata
from tpu_inference.layers.common.quantization import quantize_kv
from tpu_inference.layers.common.sharding import ShardingAxisName
from tpu_inference.layers.jax import JaxModule
from tpu_inference.layers.jax.linear import JaxEinsum

from tpu_models.host import host_platform
from tpu_models.lora_slots import LoraBatch, project

_init = nnx.initializers.normal(0.02)


def sharded(*axes) -> Callable:
    return nnx.with_partitioning(_init, axes)


# --- rotary position embeddings -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rope:
    """RoPE for one attention layer, from an HF `rope_parameters` entry.

    Supports the scalings HF Qwen3 and Gemma 3 checkpoints use: default,
    linear, llama3 and yarn. Frequencies and rotation are computed in fp32.
    """
    head_dim: int
    theta: float
    kind: str = "default"
    params: tuple = ()  # sorted (key, value) pairs of the scaling parameters
    max_position_embeddings: int = 0

    @classmethod
    def from_hf(cls, params: dict | None, head_dim: int, max_position_embeddings: int,
                default_theta: float = 10000.0) -> "Rope":
        params = dict(params or {})
        theta = float(params.pop("rope_theta", default_theta))
        kind = params.pop("rope_type", params.pop("type", "default"))
        if kind not in ("default", "linear", "llama3", "yarn"):
            raise ValueError(f"rope_type {kind!r} is not supported "
                             "(supported: default, linear, llama3, yarn)")
        return cls(head_dim, theta, kind, tuple(sorted(params.items())),
                   max_position_embeddings)

    def inv_freq_and_scale(self) -> tuple[jax.Array, float]:
        p = dict(self.params)
        exponents = jnp.arange(0, self.head_dim, 2, dtype=jnp.float32) / self.head_dim
        inv_freq = 1.0 / self.theta**exponents
        if self.kind == "linear":
            return inv_freq / p["factor"], 1.0
        if self.kind == "llama3":
            factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
            old_len = p["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv_freq
            smooth = (old_len / wavelen - low) / (high - low)
            blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
            return jnp.where(wavelen > old_len / low, inv_freq / factor,
                             jnp.where(wavelen < old_len / high, inv_freq, blended)), 1.0
        if self.kind == "yarn":
            return self._yarn(inv_freq, p)
        return inv_freq, 1.0

    def _yarn(self, inv_freq, p) -> tuple[jax.Array, float]:
        factor = p["factor"]
        old_len = p.get("original_max_position_embeddings") or self.max_position_embeddings
        beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            if p.get("mscale") and p.get("mscale_all_dim"):
                attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
            else:
                attention_factor = mscale(factor)

        def correction_dim(rotations):
            return (self.head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.head_dim - 1)
        if low == high:
            high += 0.001
        ramp = jnp.clip((jnp.arange(self.head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, attention_factor

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [T, heads, H] rotated by positions [T] (HF "rotate_half" pairing)."""
        inv_freq, scale = self.inv_freq_and_scale()
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
        cos, sin = (jnp.cos(angles) * scale)[:, None, :], (jnp.sin(angles) * scale)[:, None, :]
        x1, x2 = x[..., :self.head_dim // 2], x[..., self.head_dim // 2:]  # fp32 by promotion
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# --- tied vocab projection ---------------------------------------------------


def tied_logits(embed, x: jax.Array) -> jax.Array:
    """x [T, D] against the tied embedding table [V, D] -> logits [T, V]."""
    table = embed.weight.value
    # The platform the model is built for: `tpu-models compile` traces on a CPU for a TPU.
    if host_platform() == "cpu" and isinstance(table, jax.Array):
        # XLA:CPU's dot against a [V, D] table (contracting D, its minor axis) reads
        # it at a third of the speed of a [D, V] one; a multiply-reduce fuses into
        # one loop that streams the table once over every core (2-3x faster at a
        # decode step's 1-16 rows; with the table as the first operand: the other
        # order measured 2x slower).
        out = (table.astype(jnp.float32)[None] * x.astype(jnp.float32)[:, None, :]).sum(-1)
        return out.astype(jnp.result_type(x, table))
    return embed.decode(x)  # quantized tables (Qwix) and accelerators: the engine's dot


# --- MLP -------------------------------------------------------------------------


class GatedMLP(JaxModule):
    """down_proj(act(gate_proj(x)) * up_proj(x)), as HF's Qwen3/Gemma MLPs."""

    def __init__(self, hidden: int, width: int, activation: Callable, *, dtype, param_dtype,
                 rngs: nnx.Rngs, quant_config=None, prefix: str = ""):
        def proj(name, spec, shape, axes):
            return JaxEinsum(spec, shape, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                             kernel_init=sharded(*axes), quant_config=quant_config,
                             prefix=f"{prefix}.{name}")

        mlp = ShardingAxisName.MLP_TENSOR
        self.gate_proj = proj("gate_proj", "TD,DF->TF", (hidden, width), (None, mlp))
        self.up_proj = proj("up_proj", "TD,DF->TF", (hidden, width), (None, mlp))
        self.down_proj = proj("down_proj", "TF,FD->TD", (width, hidden), (mlp, None))
        self.activation = activation

    def __call__(self, x: jax.Array, lora: LoraBatch | None = None) -> jax.Array:
        h = self.activation(project(self.gate_proj, x, lora)) * project(self.up_proj, x, lora)
        return project(self.down_proj, h, lora)


# --- attention -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: Rope
    scale: float  # multiplies q.k
    bias: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None
    head_shards: int = 1  # tensor-parallel devices the heads are split over

    def __post_init__(self):
        if self.num_heads % self.head_shards:
            raise ValueError(f"{self.num_heads} attention heads do not split over "
                             f"tensor parallel size {self.head_shards}")
        if self.num_kv_heads % self.head_shards and self.head_shards % self.num_kv_heads:
            raise ValueError(f"{self.num_kv_heads} KV heads and tensor parallel size "
                             f"{self.head_shards}: one must divide the other")


# The layers' kernel calls are alike within a step. Jitted, the call (tpu-inference's
# shard_map around the kernel) is staged and lowered once a step shape, not once a
# layer: a quarter of an 0.6B shape's `tpu-models compile` time. XLA inlines it.
@functools.partial(jax.jit, static_argnames=(
    "mesh", "head_dim", "sm_scale", "window", "soft_cap", "kv_scale", "backend"))
def paged_attention(kv_cache, q, k, v, md: AttentionMetadata, *, mesh, head_dim, sm_scale,
                    window, soft_cap, kv_scale, backend):
    return attention(kv_cache, q, k, v, md, mesh, head_dim, sm_scale=sm_scale,
                     attention_chunk_size=window, attn_logits_soft_cap=soft_cap,
                     k_scale=kv_scale, v_scale=kv_scale, attention_backend=backend)


class Attention(JaxModule):
    """q/k/v/o projections, optional q/k norms, RoPE, and paged attention.

    `qk_norm` builds the per-head norms (None: none). The kernel is the
    tpu-inference attention backend `runtime.attention_backend` picks: the
    engine's (RPA) on TPU, the portable kernel elsewhere or when
    `--attention-backend portable` asks for it.
    """

    def __init__(self, cfg: AttentionConfig, *, dtype, param_dtype, rngs: nnx.Rngs, mesh,
                 backend: AttentionBackend | None, kv_cache_dtype: str = "auto",
                 qk_norm: Callable[[str], Any] | None = None, quant_config=None,
                 prefix: str = ""):
        self.cfg = cfg
        self.mesh = mesh
        self.backend = backend
        heads = ShardingAxisName.ATTN_HEAD
        # Fewer KV heads than shards: every device computes all of them (cheap:
        # K is small) and attention hands each shard the copy its queries use.
        kv_heads = ShardingAxisName.KV_HEAD if cfg.num_kv_heads % cfg.head_shards == 0 else None
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def proj(name, spec, shape, axes, bias_shape, bias_axes):
            return JaxEinsum(
                spec, shape, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                kernel_init=sharded(*axes),
                bias_shape=bias_shape if cfg.bias else None,
                bias_init=nnx.with_partitioning(nnx.initializers.zeros, bias_axes),
                quant_config=quant_config, prefix=f"{prefix}.{name}")

        self.q_proj = proj("q_proj", "TD,DNH->TNH", (D, N, H), (None, heads, None), (N, H), (heads, None))
        self.k_proj = proj("k_proj", "TD,DKH->TKH", (D, K, H), (None, kv_heads, None), (K, H), (kv_heads, None))
        self.v_proj = proj("v_proj", "TD,DKH->TKH", (D, K, H), (None, kv_heads, None), (K, H), (kv_heads, None))
        # Heads are "A" here: jnp.einsum contracts its summed axes in alphabetical
        # order, and (H, N) would make XLA:CPU transpose the whole kernel every step.
        self.o_proj = proj("o_proj", "TAH,AHD->TD", (N, H, D), (heads, None, None), (D,), (None,))
        if qk_norm is not None:
            self.q_norm = qk_norm(f"{prefix}.q_norm")
            self.k_norm = qk_norm(f"{prefix}.k_norm")
        self.kv_cache_dtype = None if kv_cache_dtype == "auto" else kv_cache_dtype

    def __call__(self, kv_cache: jax.Array, x: jax.Array, md: AttentionMetadata,
                 lora: LoraBatch | None = None) -> tuple[jax.Array, jax.Array]:
        q = project(self.q_proj, x, lora)  # [T, N, H]
        k = project(self.k_proj, x, lora)  # [T, K, H]
        v = project(self.v_proj, x, lora)  # [T, K, H]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.cfg.rope(q, md.input_positions)
        k = self.cfg.rope(k, md.input_positions)
        kv_scale = None
        if self.kv_cache_dtype is not None:
            from tpu_inference.utils import get_jax_dtype_from_str_dtype
            kv_scale = 1.0
            k, v = quantize_kv(get_jax_dtype_from_str_dtype(self.kv_cache_dtype), k, v,
                               kv_scale, kv_scale)
        kv_cache, out = paged_attention(
            kv_cache, q, k, v, md, mesh=self.mesh, head_dim=self.cfg.head_dim,
            sm_scale=self.cfg.scale, window=self.cfg.sliding_window,
            soft_cap=self.cfg.soft_cap, kv_scale=kv_scale, backend=self.backend)
        return kv_cache, project(self.o_proj, out, lora)  # [T, D]
