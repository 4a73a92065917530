"""Small, real training checkpoints to try the exporter on, written from an HF checkpoint.

`tpu-models export examples DIR` writes, from the embedded demo's weights (a
3.5M-parameter Qwen3-structural), what docs/export.md's examples read:

    DIR/maxtext-run          MaxText training state, unscanned (decoder/layers_{i})
    DIR/maxtext-run-scanned  the same, scanned (layers stacked on axis 1)
    DIR/tokenizer            the demo's tokenizer files
    DIR/qwen3-base           the demo without its structural head: an HF Qwen3
    DIR/tunix-ckpt           a Tunix full fine-tune of qwen3-base (<step>/model_params)
    DIR/tunix-lora           a Tunix LoRA run on qwen3-base: qwix A/B of rank 4 on every
                             projection, random (alpha is not stored: --lora-alpha)

Each is the loader's name table read backwards (loaders.maxtext.to_maxtext_tree,
Rule.to_source_array), saved with orbax as MaxText and Tunix save theirs.
"""

import json
import shutil
from pathlib import Path

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
LORA_RANK = 4


def write_examples(hf_dir: Path, out: Path, *, maxtext, tunix, base_shapes: dict) -> list[Path]:
    """The example checkpoints under `out` (created), from the Qwen3-structural HF
    checkpoint `hf_dir`: `maxtext` is its MaxText mapping, `tunix` Qwen3's Tunix mapping,
    `base_shapes` the Qwen3 base's HF name -> shape."""
    from safetensors.numpy import load_file

    from tpu_models.loaders.maxtext import to_maxtext_tree

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    out.mkdir(parents=True, exist_ok=True)
    written = [_copy_tokenizer(hf_dir, out / "tokenizer")]
    for name, scanned in (("maxtext-run", False), ("maxtext-run-scanned", True)):
        tree = to_maxtext_tree(tensors, maxtext, config, scanned=scanned)
        _save(out / name / "checkpoints" / "0" / "items", {"params": {"params": tree}})
        written.append(out / name)
    base = {k: v for k, v in tensors.items() if k in base_shapes}
    written.append(_hf_base(hf_dir, out / "qwen3-base", base, config))
    _save(out / "tunix-ckpt" / "1" / "model_params", _values(_tunix_weights(base, tunix, config)))
    _save(out / "tunix-lora" / "1" / "model_params",
          _values(_tunix_lora(tunix, config, base_shapes)))
    return [*written, out / "tunix-ckpt", out / "tunix-lora"]


def _copy_tokenizer(hf_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (hf_dir / name).exists():
            shutil.copy(hf_dir / name, out / name)
    return out


def _hf_base(hf_dir: Path, out: Path, tensors: dict, config: dict) -> Path:
    from safetensors.numpy import save_file
    _copy_tokenizer(hf_dir, out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(
        {**config, "architectures": ["Qwen3ForCausalLM"]}, indent=2))
    return out


def _sizes(config: dict) -> dict[str, int]:
    return {"n": config["num_attention_heads"], "k": config["num_key_value_heads"],
            "h": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]}


def _tunix_weights(tensors: dict, mapping, config: dict) -> dict[str, np.ndarray]:
    """Tunix's parameter paths for HF tensors: its weight rules read backwards."""
    from tpu_models.loaders.conversion_rules import expand
    sizes = _sizes(config)
    return {rule.source: rule.to_source_array(tensors[name], sizes)
            for name, rule in expand(mapping.weights, config["num_hidden_layers"]).items()
            if name in tensors}  # lm_head: tied here


def _tunix_lora(mapping, config: dict, shapes: dict) -> dict[str, np.ndarray]:
    """qwix's `<weight>_lora_a` / `_lora_b` for random PEFT A [r, in], B [out, r]."""
    from einops import rearrange

    rng = np.random.default_rng(0)
    h = {"h": _sizes(config)["h"]}
    leaves = {}
    for weight, rules in mapping.lora.items():
        (rule,) = rules  # Qwen3's: one HF module a Tunix weight
        for i in range(config["num_hidden_layers"]):
            out_size, in_size = shapes[rule.module.format(i=i) + ".weight"]
            a = rng.normal(0, 0.05, (LORA_RANK, in_size)).astype(np.float32)
            b = rng.normal(0, 0.05, (out_size, LORA_RANK)).astype(np.float32)
            for part, array, pattern in (("a", a, rule.a), ("b", b, rule.b)):
                backwards = _backwards(pattern)
                sizes = h if "h" in backwards else {}
                leaves[f"{weight.format(i=i)}_lora_{part}"] = rearrange(array, backwards, **sizes)
    return leaves


def _backwards(pattern: str) -> str:
    left, right = (side.strip() for side in pattern.split("->"))
    return f"{right} -> {left}"


def _values(leaves: dict[str, np.ndarray]) -> dict:
    """A nested tree of NNX state, `.../value` at each leaf, as Tunix saves it."""
    tree: dict = {}
    for path, array in leaves.items():
        node = tree
        for key in path.split("/"):
            node = node.setdefault(key, {})
        node["value"] = np.ascontiguousarray(array)
    return tree


def _save(item: Path, tree: dict) -> None:
    import orbax.checkpoint as ocp
    ocp.PyTreeCheckpointer().save(item.absolute(), tree)
