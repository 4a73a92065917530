"""Tunix (google/tunix) trainer checkpoints -> HF tensors and PEFT adapters.

Tunix's PeftTrainer saves `<root>/<step>/model_params` (+ optimizer_state,
which we ignore) with orbax; leaves are NNX state paths ending in `value`,
layers keyed by index: `layers/0/attn/q_einsum/w/value`. A full fine-tune
holds every weight; a LoRA run holds only qwix's `<weight>_lora_a` and
`<weight>_lora_b` (the trainer saves LoRA params alone), with the rank in
their shapes and no alpha anywhere (it is an input, or custom metadata).

qwix's LoRA computes x @ A @ B * alpha / rank with A holding the weight axes
that contract with x, then r, and B holding r, then the remaining axes. For
HF both become PEFT matrices: A_hf [r, in], B_hf [out, r].

Layouts (Tunix, HF): Gemma 3 q_einsum [N, D, H] vs q_proj [N*H, D], kv_einsum
[2, K, D, H] (k, v), attn_vec_einsum [N, H, D] vs o_proj [D, N*H]; Qwen3
q_proj [D, N, H], o_proj [N, H, D]; MLP kernels [in, out] vs [out, in]. No
value transforms: Gemma's (1 + scale) norms and sqrt(D) embedding scale are
the same in both.
"""

import dataclasses

import numpy as np

from loaders.hf import CheckpointError
from loaders.orbax_io import OrbaxCheckpoint
from loaders.rules import Rule

_NORMS_GEMMA3 = {
    "model.layers.{i}.input_layernorm.weight": Rule("layers/{i}/pre_attention_norm/scale"),
    "model.layers.{i}.post_attention_layernorm.weight": Rule("layers/{i}/post_attention_norm/scale"),
    "model.layers.{i}.pre_feedforward_layernorm.weight": Rule("layers/{i}/pre_ffw_norm/scale"),
    "model.layers.{i}.post_feedforward_layernorm.weight": Rule("layers/{i}/post_ffw_norm/scale"),
    "model.layers.{i}.self_attn.q_norm.weight": Rule("layers/{i}/attn/_query_norm/scale"),
    "model.layers.{i}.self_attn.k_norm.weight": Rule("layers/{i}/attn/_key_norm/scale"),
}
_MLP = {
    "model.layers.{i}.mlp.gate_proj.weight": Rule("layers/{i}/mlp/gate_proj/kernel", "d f -> f d"),
    "model.layers.{i}.mlp.up_proj.weight": Rule("layers/{i}/mlp/up_proj/kernel", "d f -> f d"),
    "model.layers.{i}.mlp.down_proj.weight": Rule("layers/{i}/mlp/down_proj/kernel", "f d -> d f"),
}

GEMMA3 = {
    "model.embed_tokens.weight": Rule("embedder/input_embedding"),
    "model.norm.weight": Rule("final_norm/scale"),
    **_NORMS_GEMMA3,
    "model.layers.{i}.self_attn.q_proj.weight": Rule("layers/{i}/attn/q_einsum/w", "n d h -> (n h) d"),
    "model.layers.{i}.self_attn.k_proj.weight": Rule("layers/{i}/attn/kv_einsum/w", "k d h -> (k h) d", 0),
    "model.layers.{i}.self_attn.v_proj.weight": Rule("layers/{i}/attn/kv_einsum/w", "k d h -> (k h) d", 1),
    "model.layers.{i}.self_attn.o_proj.weight": Rule("layers/{i}/attn/attn_vec_einsum/w", "n h d -> d (n h)"),
    **_MLP,
}
# Gemma 3 with as many KV heads as query heads fuses q, k and v.
GEMMA3_MHA = {
    **GEMMA3,
    "model.layers.{i}.self_attn.q_proj.weight": Rule("layers/{i}/attn/qkv_einsum/w", "n d h -> (n h) d", 0),
    "model.layers.{i}.self_attn.k_proj.weight": Rule("layers/{i}/attn/qkv_einsum/w", "n d h -> (n h) d", 1),
    "model.layers.{i}.self_attn.v_proj.weight": Rule("layers/{i}/attn/qkv_einsum/w", "n d h -> (n h) d", 2),
}

QWEN3 = {
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
    **_MLP,
}


@dataclasses.dataclass(frozen=True)
class LoraRule:
    """qwix A/B of one Tunix weight -> PEFT A [r, in], B [out, r] of one HF module."""
    module: str  # HF module, "{i}" for the layer
    a: str  # einops pattern, qwix A -> PEFT A
    b: str  # einops pattern, qwix B -> PEFT B
    index: int | None = None  # which part of a fused weight (qwix B axis 1)


_MLP_LORA = {
    "layers/{i}/mlp/gate_proj/kernel": [LoraRule("model.layers.{i}.mlp.gate_proj", "i r -> r i", "r o -> o r")],
    "layers/{i}/mlp/up_proj/kernel": [LoraRule("model.layers.{i}.mlp.up_proj", "i r -> r i", "r o -> o r")],
    "layers/{i}/mlp/down_proj/kernel": [LoraRule("model.layers.{i}.mlp.down_proj", "i r -> r i", "r o -> o r")],
}
GEMMA3_LORA = {
    "layers/{i}/attn/q_einsum/w": [LoraRule("model.layers.{i}.self_attn.q_proj", "d r -> r d", "r n h -> (n h) r")],
    "layers/{i}/attn/kv_einsum/w": [
        LoraRule(f"model.layers.{{i}}.self_attn.{p}_proj", "d r -> r d", "r k h -> (k h) r", j)
        for j, p in enumerate("kv")],
    "layers/{i}/attn/qkv_einsum/w": [
        LoraRule(f"model.layers.{{i}}.self_attn.{p}_proj", "d r -> r d", "r n h -> (n h) r", j)
        for j, p in enumerate("qkv")],
    "layers/{i}/attn/attn_vec_einsum/w": [
        LoraRule("model.layers.{i}.self_attn.o_proj", "n h r -> r (n h)", "r d -> d r")],
    **_MLP_LORA,
}
QWEN3_LORA = {
    **{f"layers/{{i}}/attn/{p}_proj/w": [
        LoraRule(f"model.layers.{{i}}.self_attn.{p}_proj", "d r -> r d", "r n h -> (n h) r")]
       for p in "qkv"},
    "layers/{i}/attn/o_proj/w": [LoraRule("model.layers.{i}.self_attn.o_proj", "n h r -> r (n h)", "r d -> d r")],
    **_MLP_LORA,
}


class TunixCheckpoint:
    """A Tunix model_params tree, with its family (gemma3 / qwen3) and kind (full / LoRA)."""

    def __init__(self, path):
        self.orbax = OrbaxCheckpoint(path)
        self.leaves = {name.removesuffix("/value"): name for name in self.orbax.leaves}
        names = set(self.leaves)
        if not names:
            raise CheckpointError(f"{self.orbax.item}: empty parameter tree")
        self.is_lora = all(n.endswith(("_lora_a", "_lora_b")) for n in names)
        if any("/attn/q_einsum/" in n or "/attn/qkv_einsum/" in n or "/attn/attn_vec_einsum/" in n
               for n in names):
            self.family = "gemma3"
        elif any("/attn/q_proj/" in n for n in names):
            self.family = "qwen3"
        else:
            raise CheckpointError(f"{self.orbax.item}: neither a Tunix Gemma 3 nor Qwen3 tree "
                                  f"(first leaves: {sorted(names)[:4]})")

    def shape(self, leaf: str) -> tuple[int, ...]:
        return self.orbax.leaves[self.leaves[leaf]][0]

    def read(self, leaf: str) -> np.ndarray:
        if leaf not in self.leaves:
            raise CheckpointError(f"{self.orbax.item}: no tensor {leaf}")
        return self.orbax.read(self.leaves[leaf])

    def weight_table(self) -> dict[str, Rule]:
        if self.family == "qwen3":
            return QWEN3
        fused = any("/attn/qkv_einsum/" in n for n in self.leaves)
        return GEMMA3_MHA if fused else GEMMA3

    def lora_pairs(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """HF module weight name -> (PEFT A [r, in], PEFT B [out, r]), fp32."""
        table = GEMMA3_LORA if self.family == "gemma3" else QWEN3_LORA
        weights = sorted({n.rsplit("_lora_", 1)[0] for n in self.leaves})
        pairs = {}
        for weight in weights:
            layer, pattern = _layer_pattern(weight)
            rules = table.get(pattern)
            if rules is None:
                raise CheckpointError(f"{self.orbax.item}: LoRA on {weight}, which has no HF "
                                      "projection to merge into")
            a, b = self.read(f"{weight}_lora_a"), self.read(f"{weight}_lora_b")
            if a.shape[-1] != b.shape[0]:
                raise CheckpointError(f"{self.orbax.item}: {weight}: lora_a {list(a.shape)} and "
                                      f"lora_b {list(b.shape)} disagree on the rank")
            for rule in rules:
                part = b if rule.index is None else np.take(b, rule.index, axis=1)
                from einops import rearrange
                name = rule.module.format(i=layer) + ".weight"
                pairs[name] = (rearrange(a.astype(np.float32), rule.a),
                               rearrange(part.astype(np.float32), rule.b))
        return pairs


def _layer_pattern(path: str) -> tuple[int | None, str]:
    parts = path.split("/")
    if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1]), "/".join(["layers", "{i}", *parts[2:]])
    return None, path
