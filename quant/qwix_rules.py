"""Qwix quantization rules as data: presets and user rule files, checked before use.

A rules file is what tpu-inference reads from `--additional-config
'{"quantization": ...}'`, written as YAML, plus an optional one-line
`description`:

    description: int8 per-channel weights
    qwix:
      rules:                        # first match wins
        - module_path: '.*norm'     # no qtype: stays in the model dtype
        - module_path: 'model/layers/\\d+/(self_attn|mlp)/\\w+_proj'
          weight_qtype: int8

Each rule's keys are exactly `qwix.QuantizationRule`'s fields. Qwix matches
`module_path` (fullmatch) against NNX module paths joined by "/", e.g.
`model/layers/3/mlp/up_proj`. Presets live in quant/presets/<name>.yaml.

tpu-inference itself would accept a malformed rule and fail (or silently
quantize nothing) after the model is built; `load()` fails first, naming the
file, the rule and the field.
"""

import re
from pathlib import Path

import yaml

PRESETS_DIR = Path(__file__).parent / "presets"

# qwix.QuantizationRule's fields (checked against qwix in the tests, kept here
# so that validating a file does not import JAX).
RULE_FIELDS = ("module_path", "op_names", "weight_qtype", "act_qtype", "tile_size",
               "act_static_scale", "weight_calibration_method", "act_calibration_method",
               "act_batch_axes")
# Types Qwix can quantize to (qwix/_src/core/numerics.py).
QTYPES = ("int8", "int4", "int2", "int3", "int5", "int6", "int7", "uint8", "uint4", "nf4",
          "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")
# Ops Qwix's PTQ provider intercepts.
OP_NAMES = ("einsum", "dot_general", "dot", "conv_general_dilated")
# Calibration methods and how many numeric arguments each takes.
CALIBRATIONS = {"absmax": (0, 1), "minmax": (0, 1), "rms": (1, 1), "fixed": (1, 2)}
# Keys of the "qwix" mapping besides "rules" that tpu-inference reads.
QWIX_KEYS = ("rules", "use_abstract_model", "scale_dtype")


class RulesError(ValueError):
    """A rules file or preset that cannot be used; the message names where."""


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def resolve(spec: str) -> Path:
    """A preset name or a path to a rules file -> the file."""
    if spec in preset_names():
        return PRESETS_DIR / f"{spec}.yaml"
    path = Path(spec)
    if path.is_file():
        return path
    raise RulesError(f"--quant {spec!r}: neither a preset ({', '.join(preset_names())}) "
                     "nor a rules file")


def load(spec: str) -> dict:
    """Reads and validates a preset or rules file; returns tpu-inference's
    `additional_config["quantization"]` value (`{"qwix": {"rules": [...]}}`)."""
    path = resolve(spec)
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RulesError(f"{path}: not valid YAML: {e}") from None
    return validate(document, source=str(path))


def additional_config(spec: str) -> dict:
    """The `--additional-config` entry that quantizes with `spec`."""
    return {"quantization": load(spec)}


def validate(document, source: str = "<rules>") -> dict:
    """Checks a parsed rules document; returns it without our own keys."""
    if not isinstance(document, dict):
        raise RulesError(f"{source}: expected a mapping with a 'qwix' key, got "
                         f"{type(document).__name__}")
    unknown = set(document) - {"qwix", "description"}
    if unknown:
        raise RulesError(f"{source}: unknown top-level key(s) {sorted(unknown)} "
                         "(expected: qwix, description)")
    qwix = document.get("qwix")
    if not isinstance(qwix, dict) or "rules" not in qwix:
        raise RulesError(f"{source}: expected 'qwix: {{rules: [...]}}'")
    unknown = set(qwix) - set(QWIX_KEYS)
    if unknown:
        raise RulesError(f"{source}: unknown key(s) under qwix: {sorted(unknown)} "
                         f"(expected: {', '.join(QWIX_KEYS)})")
    if qwix.get("use_abstract_model"):
        raise RulesError(f"{source}: qwix.use_abstract_model is not supported: tpu-models "
                         "loads checkpoint tensors, then Qwix quantizes them")
    rules = qwix["rules"]
    if not isinstance(rules, list) or not rules:
        raise RulesError(f"{source}: qwix.rules must be a non-empty list")
    for index, rule in enumerate(rules):
        _check_rule(rule, f"{source}: rules[{index}]")
    return {"qwix": dict(qwix)}


def _check_rule(rule, where: str) -> None:
    if not isinstance(rule, dict):
        raise RulesError(f"{where}: expected a mapping of QuantizationRule fields, "
                         f"got {type(rule).__name__}")
    for field in rule:
        if field not in RULE_FIELDS:
            raise RulesError(f"{where}: unknown field {field!r} "
                             f"(qwix.QuantizationRule fields: {', '.join(RULE_FIELDS)})")
    if "module_path" not in rule:
        raise RulesError(f"{where}.module_path: missing (a regex over module paths "
                         "such as model/layers/0/mlp/up_proj)")
    path = rule["module_path"]
    if not isinstance(path, str):
        raise RulesError(f"{where}.module_path: expected a regex string, got {path!r}")
    try:
        re.compile(path)
    except re.error as e:
        raise RulesError(f"{where}.module_path: bad regex {path!r}: {e}") from None
    for field in ("weight_qtype", "act_qtype"):
        qtype = rule.get(field)
        if qtype is not None and qtype not in QTYPES:
            raise RulesError(f"{where}.{field}: unknown qtype {qtype!r} "
                             f"(known: {', '.join(QTYPES)})")
    if rule.get("act_qtype") is not None and rule.get("weight_qtype") is None:
        raise RulesError(f"{where}.act_qtype: set without weight_qtype; Qwix's PTQ skips "
                         "such rules, so the activations would silently stay unquantized")
    tile = rule.get("tile_size")
    if tile is not None and not (
            (isinstance(tile, int) and not isinstance(tile, bool) and tile > 0)
            or (isinstance(tile, float) and 0 < tile <= 1)):
        raise RulesError(f"{where}.tile_size: expected a positive integer (channels per "
                         f"tile) or a fraction 1/tiles, got {tile!r}")
    for field in ("weight_calibration_method", "act_calibration_method"):
        if rule.get(field) is not None:
            _check_calibration(rule[field], f"{where}.{field}")
    ops = rule.get("op_names", ())
    if isinstance(ops, str) or not isinstance(ops, (list, tuple)) or any(
            op not in OP_NAMES for op in ops):
        raise RulesError(f"{where}.op_names: expected a list of {', '.join(OP_NAMES)}, "
                         f"got {ops!r}")
    if "act_static_scale" in rule and not isinstance(rule["act_static_scale"], (bool, type(None))):
        raise RulesError(f"{where}.act_static_scale: expected true/false")
    if rule.get("act_static_scale"):
        raise RulesError(f"{where}.act_static_scale: not supported: tpu-inference calibrates "
                         "while tracing the model on random token ids, so static activation "
                         "scales would be fitted to noise; leave it unset (dynamic scales)")
    axes = rule.get("act_batch_axes", [0])
    if not isinstance(axes, (list, tuple)) or not all(
            isinstance(a, int) and not isinstance(a, bool) for a in axes):
        raise RulesError(f"{where}.act_batch_axes: expected a list of axis numbers")


def _check_calibration(method, where: str) -> None:
    if not isinstance(method, str):
        raise RulesError(f"{where}: expected a string such as 'absmax' or 'fixed,-4,4'")
    name, *args = method.lower().split(",")
    if name not in CALIBRATIONS:
        raise RulesError(f"{where}: unknown calibration {name!r} "
                         f"(known: {', '.join(CALIBRATIONS)})")
    low, high = CALIBRATIONS[name]
    try:
        values = [float(a) for a in args]
    except ValueError:
        raise RulesError(f"{where}: arguments of {method!r} must be numbers") from None
    if not low <= len(values) <= high:
        raise RulesError(f"{where}: {name} takes {low}..{high} numeric argument(s), "
                         f"got {method!r}")
