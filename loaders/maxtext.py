"""MaxText checkpoints -> HF: names, layouts and conventions, and back.

Where MaxText (0.2.x) keeps a decoder's parameters:

    full state (training)   params/params/{token_embedder, decoder}/...   + opt_state, step, nnx_aux
    parameters only (NNX)   {token_embedder, decoder}/.../value
    unscanned               decoder/layers_{i}/...
    scanned                 decoder/layers/...          layer axis `param_scan_axis` (1) of every leaf
    scanned Gemma 3         decoder/layers/layers_{j}/  j < 6, over blocks of 6 layers (5 local, 1
                            global): layer = 6 * block + j; leftovers in decoder/layers_remainder/layers_{k}

Kernels are [in..., out...] einsum layouts (query [D, N, H], out [N, H, D],
wi_0/wi_1 [D, F], wo [F, D], logits_dense [D, V]); HF Linear weights are
[out, in]. MaxText's Gemma 3 conventions differ in value: its RMSNorm
multiplies by the stored scale, which includes HF's "+1", and its embedding
table is stored pre-multiplied by sqrt(D) (the tied logits divide by it
again). We undo both exactly (fp64 arithmetic, one rounding), so the HF model
computes MaxText's function; MaxText's own converter divides by a
bfloat16-rounded sqrt(D) instead, which shifts logits by up to 0.2%.

Each architecture's mapping (MaxTextMapping, in tpu_models/<arch>/checkpoints.py)
names its layer's leaves and conventions; Dense layers our fork adds (the
structural head) are found wherever they sit: any `.../structural_head/{kernel, bias}`.

The same tables, read backwards (`to_maxtext_tree`),
write MaxText's layout from HF tensors; the tests build fixtures that way.
"""

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from tpu_models.loaders.hf import CheckpointError
from tpu_models.loaders.orbax_io import OrbaxCheckpoint
from tpu_models.loaders.conversion_rules import Rule

# MaxText's decoder layer, HF name below model.layers.{i}. -> leaf below the
# layer's subtree; each architecture adds its norms (tpu_models/<arch>/checkpoints.py).
PROJECTIONS = {
    "self_attn.q_proj.weight": Rule("self_attention/query/kernel", "d n h -> (n h) d"),
    "self_attn.k_proj.weight": Rule("self_attention/key/kernel", "d k h -> (k h) d"),
    "self_attn.v_proj.weight": Rule("self_attention/value/kernel", "d k h -> (k h) d"),
    "self_attn.o_proj.weight": Rule("self_attention/out/kernel", "n h d -> d (n h)"),
    "mlp.gate_proj.weight": Rule("mlp/wi_0/kernel", "d f -> f d"),
    "mlp.up_proj.weight": Rule("mlp/wi_1/kernel", "d f -> f d"),
    "mlp.down_proj.weight": Rule("mlp/wo/kernel", "f d -> d f"),
}
BIASES = {
    "self_attn.q_proj.bias": Rule("self_attention/query/bias", "n h -> (n h)"),
    "self_attn.k_proj.bias": Rule("self_attention/key/bias", "k h -> (k h)"),
    "self_attn.v_proj.bias": Rule("self_attention/value/bias", "k h -> (k h)"),
    "self_attn.o_proj.bias": Rule("self_attention/out/bias"),
}


def decoder_globals(*, embedding_scale: float = 1.0, norm_offset: float = 0.0) -> dict[str, Rule]:
    """Embedding, final norm and untied logits, with the value conventions that differ."""
    return {
        "model.embed_tokens.weight": Rule("token_embedder/embedding", scale=embedding_scale),
        "model.norm.weight": Rule("decoder/decoder_norm/scale", offset=norm_offset),
        "lm_head.weight": Rule("decoder/logits_dense/kernel", "d v -> v d"),
    }


@dataclasses.dataclass(frozen=True)
class MaxTextMapping:
    """One architecture's MaxText decoder, as HF names."""
    layer: dict[str, Rule]  # HF name below model.layers.{i}. -> leaf below the layer's subtree
    globals: Callable[[int], dict[str, Rule]]  # hidden size -> decoder_globals(...)
    config: Callable[[dict], dict]  # sizes read off the tensors -> HF config.json
    scan_period: int = 0  # scanned checkpoints stack blocks of this many layers (Gemma 3: 6)
    # Dense layers our MaxText fork adds, found wherever they sit in the tree:
    # .../<name>/{kernel, bias} -> HF <name>.{weight, bias}; required when listed.
    dense_heads: tuple[str, ...] = ()

    def layer_rules(self, attention_bias: bool) -> dict[str, Rule]:
        return {**self.layer, **(BIASES if attention_bias else {})}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each decoder layer lives in the tree."""
    scanned: bool
    num_layers: int
    period: int = 0  # Gemma 3 scanned blocks: layers per block, else 0
    blocks: int = 0
    scan_axis: int = 1

    def place(self, layer: int) -> tuple[str, int | None]:
        """(subtree, index along the scan axis or None) holding `layer`."""
        if not self.scanned:
            return f"decoder/layers_{layer}", None
        if not self.period:
            return "decoder/layers", layer
        block, j = divmod(layer, self.period)
        if block < self.blocks:
            return f"decoder/layers/layers_{j}", block
        return f"decoder/layers_remainder/layers_{layer - self.blocks * self.period}", None

    def describe(self) -> str:
        if not self.scanned:
            return f"unscanned, {self.num_layers} layers (decoder/layers_{{i}})"
        if self.period:
            return (f"scanned in blocks of {self.period} (decoder/layers/layers_{{j}}, "
                    f"{self.blocks} blocks on axis {self.scan_axis}) + "
                    f"{self.num_layers - self.blocks * self.period} remainder layers, "
                    f"{self.num_layers} layers")
        return f"scanned, {self.num_layers} layers on axis {self.scan_axis} (decoder/layers)"


class MaxTextCheckpoint:
    """The parameter tree of a MaxText checkpoint, with its layout."""

    def __init__(self, path, *, scan: str = "auto", scan_axis: int = 1):
        self.orbax = OrbaxCheckpoint(path)
        self.leaves: dict[str, str] = {}  # relative name -> orbax leaf name
        for name in self.orbax.leaves:
            if name.startswith(("opt_state/", "nnx_aux/")) or name == "step":
                continue
            relative = name.removeprefix("params/params/").removesuffix("/value")
            self.leaves[relative] = name
        if "token_embedder/embedding" not in self.leaves:
            raise CheckpointError(f"{self.orbax.item}: no token_embedder/embedding; not a MaxText "
                                  "decoder checkpoint")
        self.layout = self._detect(scan, scan_axis)

    def _detect(self, scan: str, scan_axis: int) -> Layout:
        names = set(self.leaves)
        unscanned = sorted({int(m[1]) for n in names if (m := re.match(r"decoder/layers_(\d+)/", n))})
        scanned = any(n.startswith("decoder/layers/") for n in names)
        where = self.orbax.item
        if scanned and unscanned:
            raise CheckpointError(f"{where}: both decoder/layers/ and decoder/layers_N/ subtrees")
        if scan == "unscanned" and scanned:
            raise CheckpointError(f"{where}: the checkpoint is scanned (decoder/layers/ stacks "
                                  "the layers), not unscanned; drop --scan unscanned")
        if scan == "scanned" and unscanned:
            raise CheckpointError(f"{where}: the checkpoint is unscanned (decoder/layers_0/...), "
                                  "not scanned; drop --scan scanned")
        if unscanned:
            if unscanned != list(range(len(unscanned))):
                raise CheckpointError(f"{where}: layer subtrees {unscanned} are not 0..N-1")
            return Layout(scanned=False, num_layers=len(unscanned))
        if not scanned:
            raise CheckpointError(f"{where}: no decoder layers (decoder/layers or decoder/layers_0)")
        if any(n.startswith("decoder/layers/layers_") for n in names):
            sub = {int(m[1]) for n in names if (m := re.match(r"decoder/layers/layers_(\d+)/", n))}
            period = len(sub)
            first = next(n for n in sorted(names) if n.startswith("decoder/layers/layers_0/"))
            blocks = self.shape(first)[scan_axis]
            remainder = {int(m[1]) for n in names
                         if (m := re.match(r"decoder/layers_remainder/layers_(\d+)/", n))}
            return Layout(True, blocks * period + len(remainder), period, blocks, scan_axis)
        first = next(n for n in sorted(names) if n.startswith("decoder/layers/"))
        return Layout(True, self.shape(first)[scan_axis], scan_axis=scan_axis)

    def shape(self, leaf: str) -> tuple[int, ...]:
        return self.orbax.leaves[self.leaves[leaf]][0]

    def read(self, leaf: str) -> np.ndarray:
        return self.orbax.read(self.leaves[leaf])

    def layout_description(self) -> str:
        kind = ("training state (params/params/...)"
                if any(n.startswith("params/params/") for n in self.orbax.leaves)
                else "parameters only")
        return f"{kind}, {self.layout.describe()}"

    def dense_head(self, name: str) -> dict[str, Rule]:
        """Rules for HF `name`.{weight, bias} from the one .../<name>/{kernel, bias} in the tree."""
        kernels = [n for n in self.leaves if n.endswith(f"{name}/kernel")]
        if len(kernels) > 1:
            raise CheckpointError(f"{self.orbax.item}: several {name}s: {kernels}")
        if not kernels:
            raise CheckpointError(f"{self.orbax.item}: no .../{name}/kernel anywhere in the tree "
                                  "(exported as the wrong --model?)")
        base = kernels[0].removesuffix("/kernel")
        return {f"{name}.weight": Rule(f"{base}/kernel", "i o -> o i"),
                f"{name}.bias": Rule(f"{base}/bias")}

    def dims(self) -> dict[str, int]:
        """Sizes read off the tensors: vocab, hidden, heads, kv heads, head_dim, mlp, layers."""
        place, index = self.layout.place(0)

        def layer_shape(leaf):
            shape = list(self.shape(f"{place}/{leaf}"))
            if index is not None:
                del shape[self.layout.scan_axis]
            return shape

        vocab, hidden = self.shape("token_embedder/embedding")
        _, heads, head_dim = layer_shape("self_attention/query/kernel")
        _, kv_heads, _ = layer_shape("self_attention/key/kernel")
        _, mlp = layer_shape("mlp/wi_0/kernel")
        return {"vocab_size": vocab, "hidden_size": hidden, "num_attention_heads": heads,
                "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": mlp,
                "num_hidden_layers": self.layout.num_layers,
                "tie_word_embeddings": "decoder/logits_dense/kernel" not in self.leaves,
                "attention_bias": any(n.endswith("self_attention/query/bias") for n in self.leaves)}

    def rules(self, mapping: MaxTextMapping) -> dict[str, Rule]:
        """HF name -> Rule over this checkpoint's leaves."""
        dims = self.dims()
        rules = mapping.globals(dims["hidden_size"])
        if dims["tie_word_embeddings"]:
            rules.pop("lm_head.weight")
        for i in range(self.layout.num_layers):
            place, index = self.layout.place(i)
            for suffix, rule in mapping.layer_rules(dims["attention_bias"]).items():
                rules[f"model.layers.{i}.{suffix}"] = dataclasses.replace(
                    rule, source=f"{place}/{rule.source}", index=index,
                    index_axis=self.layout.scan_axis)
        for name in mapping.dense_heads:
            rules.update(self.dense_head(name))
        return rules


def to_maxtext_tree(hf: dict[str, np.ndarray], mapping, config: dict, *,
                  scanned: bool, scan_axis: int = 1) -> dict:
    """MaxText's Linen parameter tree (below params/params) for HF tensors: the
    inverse of MaxTextCheckpoint.rules (test fixtures, benchmarks, `tpu-models
    export examples`)."""
    num_layers = config["num_hidden_layers"]
    sizes = {"n": config["num_attention_heads"], "k": config["num_key_value_heads"],
             "h": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]}
    period = mapping.scan_period if scanned else 0
    blocks = num_layers // period if period else 0
    layout = Layout(scanned, num_layers, period, blocks, scan_axis)
    flat: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, rule in mapping.globals(config["hidden_size"]).items():
        if name in hf:
            flat[rule.source] = rule.to_source_array(hf[name], sizes)
    for name in mapping.dense_heads:
        flat[f"decoder/{name}/kernel"] = hf[f"{name}.weight"].T.copy()
        flat[f"decoder/{name}/bias"] = hf[f"{name}.bias"]
    for i in range(num_layers):
        place, index = layout.place(i)
        for suffix, rule in mapping.layer_rules(config.get("attention_bias", False)).items():
            array = rule.to_source_array(hf[f"model.layers.{i}.{suffix}"], sizes)
            if index is None:
                flat[f"{place}/{rule.source}"] = array
            else:
                stacks.setdefault(f"{place}/{rule.source}", {})[index] = array
    for leaf, parts in stacks.items():
        flat[leaf] = np.stack([parts[i] for i in range(len(parts))], axis=scan_axis)
    tree: dict = {}
    for leaf, array in flat.items():
        node = tree
        *parents, last = leaf.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = np.ascontiguousarray(array)
    return tree
