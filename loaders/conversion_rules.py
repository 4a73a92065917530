"""How one HF tensor is cut from one training-checkpoint leaf, and back.

A Rule names the source leaf (`{i}` = layer index), optionally an index into
a fused leaf (Tunix's kv_einsum holds k and v), and an einops pattern from the
source layout to HF's. The same rule read backwards (`to_source`) writes the
source layout from HF tensors: that is how the tests build fixtures, and the
round trip HF -> source -> HF must be exact.
"""

import dataclasses

import numpy as np
from einops import rearrange


@dataclasses.dataclass(frozen=True)
class Rule:
    source: str  # leaf path, "/"-joined; "{i}" for the layer index
    to_hf: str | None = None  # einops pattern, source -> HF; None keeps the layout
    index: int | None = None  # take source[..., index, ...] first (fused or stacked leaves)
    index_axis: int = 0
    scale: float = 1.0  # HF value = source value * scale + offset (conventions that differ)
    offset: float = 0.0

    def at(self, layer: int | None) -> "Rule":
        return self if layer is None else dataclasses.replace(
            self, source=self.source.format(i=layer))

    def _values(self, array, scale, offset):
        if scale == 1.0 and offset == 0.0:
            return array
        if not isinstance(array, np.ndarray):  # shape-only tracing
            return array * scale + offset
        # In float64, so a value transform costs at most one rounding.
        return (array.astype(np.float64) * scale + offset).astype(array.dtype)

    def to_hf_array(self, array: np.ndarray) -> np.ndarray:
        if self.index is not None:
            array = array[(slice(None), ) * self.index_axis + (self.index, )]
        array = array if self.to_hf is None else rearrange(array, self.to_hf)
        return self._values(array, self.scale, self.offset)

    def to_source_array(self, hf: np.ndarray, sizes: dict[str, int]) -> np.ndarray:
        """The (unfused, unstacked) source-layout array for an HF tensor; sizes name pattern axes."""
        hf = self._values(hf, 1.0 / self.scale, -self.offset / self.scale)
        if self.to_hf is None:
            return hf
        left, right = (side.strip() for side in self.to_hf.split("->"))
        needed = {k: v for k, v in sizes.items() if k in left.replace("(", " ").replace(")", " ").split()}
        return rearrange(hf, f"{right} -> {left}", **needed)


def expand(table: dict[str, Rule], num_layers: int) -> dict[str, Rule]:
    """HF name -> Rule with `{i}` filled in for every layer."""
    out = {}
    for name, rule in table.items():
        if "{i}" in name:
            out.update({name.format(i=i): rule.at(i) for i in range(num_layers)})
        else:
            out[name] = rule
    return out
