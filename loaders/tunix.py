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

from tpu_models.loaders.hf import CheckpointError
from tpu_models.loaders.orbax_io import OrbaxCheckpoint
from tpu_models.loaders.conversion_rules import Rule

# Tunix's MLP (both families), HF name -> Rule.
MLP = {
    "model.layers.{i}.mlp.gate_proj.weight": Rule("layers/{i}/mlp/gate_proj/kernel", "d f -> f d"),
    "model.layers.{i}.mlp.up_proj.weight": Rule("layers/{i}/mlp/up_proj/kernel", "d f -> f d"),
    "model.layers.{i}.mlp.down_proj.weight": Rule("layers/{i}/mlp/down_proj/kernel", "f d -> d f"),
}


@dataclasses.dataclass(frozen=True)
class LoraRule:
    """qwix A/B of one Tunix weight -> PEFT A [r, in], B [out, r] of one HF module."""
    module: str  # HF module, "{i}" for the layer
    a: str  # einops pattern, qwix A -> PEFT A
    b: str  # einops pattern, qwix B -> PEFT B
    index: int | None = None  # which part of a fused weight (qwix B axis 1)


MLP_LORA = {
    "layers/{i}/mlp/gate_proj/kernel": [LoraRule("model.layers.{i}.mlp.gate_proj", "i r -> r i", "r o -> o r")],
    "layers/{i}/mlp/up_proj/kernel": [LoraRule("model.layers.{i}.mlp.up_proj", "i r -> r i", "r o -> o r")],
    "layers/{i}/mlp/down_proj/kernel": [LoraRule("model.layers.{i}.mlp.down_proj", "i r -> r i", "r o -> o r")],
}


@dataclasses.dataclass(frozen=True)
class TunixMapping:
    """One Tunix model family's parameter tree, as HF names."""
    markers: tuple[str, ...]  # leaf fragments only this family's trees have
    weights: dict[str, Rule]  # HF name -> Rule, `{i}` the layer
    lora: dict[str, list[LoraRule]]  # Tunix weight (`{i}` the layer) -> the HF modules it feeds
    # Trees holding one of these fragments use `fused_weights` instead (Gemma 3's qkv_einsum).
    fused_markers: tuple[str, ...] = ()
    fused_weights: dict[str, Rule] | None = None

    def matches(self, leaves) -> bool:
        return _holds(leaves, self.markers)

    def weight_rules(self, leaves) -> dict[str, Rule]:
        return self.fused_weights if _holds(leaves, self.fused_markers) else self.weights


def _holds(leaves, fragments) -> bool:
    """Whether any leaf path contains one of `fragments`."""
    return any(f in leaf for leaf in leaves for f in fragments)


class TunixCheckpoint:
    """A Tunix model_params tree, full weights or LoRA-only."""

    def __init__(self, path):
        self.orbax = OrbaxCheckpoint(path)
        self.leaves = {name.removesuffix("/value"): name for name in self.orbax.leaves}
        if not self.leaves:
            raise CheckpointError(f"{self.orbax.item}: empty parameter tree")
        self.is_lora = all(n.endswith(("_lora_a", "_lora_b")) for n in self.leaves)

    def check_family(self, mapping: TunixMapping, name: str) -> None:
        if not mapping.matches(self.leaves):
            raise CheckpointError(f"{self.orbax.item}: not a Tunix {name} tree (first leaves: "
                                  f"{sorted(self.leaves)[:4]}); is --base the right model?")

    def shape(self, leaf: str) -> tuple[int, ...]:
        return self.orbax.leaves[self.leaves[leaf]][0]

    def read(self, leaf: str) -> np.ndarray:
        if leaf not in self.leaves:
            raise CheckpointError(f"{self.orbax.item}: no tensor {leaf}")
        return self.orbax.read(self.leaves[leaf])

    def weight_table(self, mapping: TunixMapping) -> dict[str, Rule]:
        return mapping.weight_rules(self.leaves)

    def lora_pairs(self, mapping: TunixMapping) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """HF module weight name -> (PEFT A [r, in], PEFT B [out, r]), fp32."""
        from einops import rearrange

        weights = sorted({n.rsplit("_lora_", 1)[0] for n in self.leaves})
        pairs = {}
        for weight in weights:
            layer, pattern = _layer_pattern(weight)
            rules = mapping.lora.get(pattern)
            if rules is None:
                raise CheckpointError(f"{self.orbax.item}: LoRA on {weight}, which has no HF "
                                      "projection to merge into")
            a, b = self.read(f"{weight}_lora_a"), self.read(f"{weight}_lora_b")
            if a.shape[-1] != b.shape[0]:
                raise CheckpointError(f"{self.orbax.item}: {weight}: lora_a {list(a.shape)} and "
                                      f"lora_b {list(b.shape)} disagree on the rank")
            for rule in rules:
                part = b if rule.index is None else np.take(b, rule.index, axis=1)
                name = rule.module.format(i=layer) + ".weight"
                pairs[name] = (rearrange(a.astype(np.float32), rule.a),
                               rearrange(part.astype(np.float32), rule.b))
        return pairs


def _layer_pattern(path: str) -> tuple[int | None, str]:
    parts = path.split("/")
    if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1]), "/".join(["layers", "{i}", *parts[2:]])
    return None, path
