"""Pre-quantized checkpoints: which `quantization_config` schemes load, and the
tensors they add to a checkpoint's name/shape table.

tpu-inference quantizes our JaxEinsum projections itself when config.json
carries a `quantization_config` (vLLM sets `--quantization` from it): for
compressed-tensors FP8 it builds float8_e4m3fn kernels with one scale per
output channel and quantizes activations per token on the fly. That is the
scheme tpu-models loads, as llm-compressor's FP8_DYNAMIC recipe writes it:

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                    "symmetric": true, "dynamic": false},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": true}}},
      "ignore": ["lm_head"]}

with, for every quantized `X.weight` [out, in] (float8_e4m3fn), `X.weight_scale`
[out, 1]. Anything else is refused before the model is built, naming the scheme.
"""

import re
from typing import Any, Mapping

SUPPORTED = ("compressed-tensors FP8: float8 weights with per-channel scales "
             "(strategy 'channel') and dynamic per-token float8 activations")
# HF modules that are torch Linear layers in the shared decoder (what the
# compressed-tensors target "Linear" selects); architectures add their own
# (`extra_linear`, e.g. the structural head).
DECODER_LINEAR = r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj|lm_head"


class UnsupportedQuantization(ValueError):
    """A checkpoint quantization scheme tpu-models cannot load."""


def check_scheme(quantization_config: Mapping[str, Any], where: str = "config.json") -> None:
    """Refuses, naming it, any scheme but compressed-tensors per-channel FP8."""
    method = quantization_config.get("quant_method")
    if method != "compressed-tensors":
        raise UnsupportedQuantization(
            f"{where}: quantization_config quant_method {method!r} is not supported by "
            f"tpu-models (supported: {SUPPORTED}). Serve an unquantized checkpoint, "
            "optionally with --quant PRESET.")
    if quantization_config.get("kv_cache_scheme"):
        raise UnsupportedQuantization(
            f"{where}: quantization_config kv_cache_scheme (calibrated KV-cache scales) is "
            "not supported; use --kv-cache-dtype fp8 (scale 1.0) instead")
    groups = quantization_config.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantization(f"{where}: compressed-tensors quantization_config has "
                                      "no config_groups")
    for name, group in groups.items():
        weights, acts = group.get("weights"), group.get("input_activations")
        ok_weights = (isinstance(weights, dict) and weights.get("type") == "float"
                      and weights.get("num_bits") == 8 and weights.get("strategy") == "channel"
                      and weights.get("symmetric", True) and not weights.get("dynamic")
                      and not weights.get("block_structure"))
        ok_acts = (isinstance(acts, dict) and acts.get("type") == "float"
                   and acts.get("num_bits") == 8 and acts.get("dynamic") is True
                   and acts.get("strategy") in ("token", None))
        if not (ok_weights and ok_acts):
            raise UnsupportedQuantization(
                f"{where}: compressed-tensors scheme {name} ({describe(group)}) is not "
                f"supported by tpu-models (supported: {SUPPORTED})")


def describe(group: Mapping[str, Any]) -> str:
    """'weights int4 group(128), input_activations none' and the like."""

    def one(args) -> str:
        if not isinstance(args, dict):
            return "none"
        detail = args.get("strategy") or "?"
        if args.get("group_size"):
            detail += f"({args['group_size']})"
        if args.get("block_structure"):
            detail += f"({'x'.join(map(str, args['block_structure']))})"
        kind = "float" if args.get("type") == "float" else "int"
        dynamic = " dynamic" if args.get("dynamic") else ""
        return f"{kind}{args.get('num_bits')} {detail}{dynamic}"

    return f"weights {one(group.get('weights'))}, input_activations " \
           f"{one(group.get('input_activations'))}"


def _matches(name: str, patterns) -> bool:
    """compressed-tensors targets/ignore: an exact module name or 're:<regex>'."""
    for pattern in patterns or ():
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern == name:
            return True
    return False


def quantized_modules(table: Mapping[str, tuple], quantization_config: Mapping[str, Any],
                      extra_linear=()) -> list[str]:
    """Linear modules of `table` the checkpoint stores quantized."""
    linear = re.compile("|".join([DECODER_LINEAR, *map(re.escape, extra_linear)]))
    groups = quantization_config.get("config_groups") or {}
    ignore = quantization_config.get("ignore") or ()
    out = []
    for tensor in table:
        module = tensor.removesuffix(".weight")
        if module == tensor or not linear.fullmatch(module) or _matches(module, ignore):
            continue
        if any("Linear" in (g.get("targets") or ()) or _matches(module, g.get("targets"))
               for g in groups.values()):
            out.append(module)
    return out


def checkpoint_table(table: Mapping[str, tuple], quantization_config: Mapping[str, Any],
                     where: str = "config.json", extra_linear=()) -> dict[str, tuple]:
    """`table` plus the per-channel scale of every quantized weight."""
    check_scheme(quantization_config, where)
    expected = dict(table)
    for module in quantized_modules(table, quantization_config, extra_linear):
        if module == "lm_head":
            raise UnsupportedQuantization(
                f"{where}: lm_head is quantized in this checkpoint, but tpu-inference's "
                "vocabulary projection has no quantized method; list lm_head under "
                "quantization_config.ignore and store it unquantized")
        expected[f"{module}.weight_scale"] = (table[f"{module}.weight"][0], 1)
    return expected
