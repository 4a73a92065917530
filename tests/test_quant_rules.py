"""Quantization's configuration, checked before any model is built: Qwix presets and
rule files (each preset maps onto Qwix's rules and keeps embeddings, heads, norms and
attention in high precision; a bad file is named by file, rule and field), `--quant`
on the command line, and the compressed-tensors schemes a pre-quantized checkpoint
may use. Their quality, at model level and served: test_quant.py.
"""

import dataclasses
import json
import re

import pytest
import yaml

from tpu_models.quant import checkpoint as prequantized
from tpu_models.quant import qwix_rules as rules
from tpu_models.server.serve import DEFAULT_MODEL, build_command

DEMO = DEFAULT_MODEL  # the trained Qwen3-structural demo


# --- presets and rule files ------------------------------------------------------


def test_rule_fields_are_qwix_quantization_rule_fields():
    import qwix
    assert rules.RULE_FIELDS == tuple(f.name for f in dataclasses.fields(qwix.QuantizationRule))


@pytest.mark.parametrize("preset", rules.preset_names())
def test_preset_maps_one_to_one_onto_qwix_rules(preset):
    import qwix
    config = rules.load(preset)
    for raw in config["qwix"]["rules"]:
        rule = qwix.QuantizationRule(**raw)
        assert {k: getattr(rule, k) for k in raw} == raw
    assert yaml.safe_load(rules.resolve(preset).read_text())["description"]


def first_rule(config: dict, module_path: str) -> dict | None:
    """The rule Qwix applies to a module: the first whose module_path fully matches."""
    return next((r for r in config["qwix"]["rules"] if re.fullmatch(r["module_path"], module_path)),
                None)


HIGH_PRECISION = ["model/embed_tokens", "lm_head", "structural_head", "model/norm",
                  "model/layers/0/input_layernorm", "model/layers/3/post_attention_layernorm",
                  "model/layers/0/self_attn/q_norm", "model/layers/1/self_attn/k_norm",
                  "model/layers/2/pre_feedforward_layernorm",
                  "model/layers/2/post_feedforward_layernorm",
                  "model/layers/0/self_attn"]  # attention's own q.k and p.v einsums
PROJECTIONS = [f"model/layers/{i}/{m}" for i in (0, 17) for m in (
    "self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
    "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")]


@pytest.mark.parametrize("preset", rules.preset_names())
def test_preset_keeps_embeddings_heads_norms_and_attention_in_high_precision(preset):
    config = rules.load(preset)
    for path in HIGH_PRECISION:
        rule = first_rule(config, path)
        assert rule is None or rule.get("weight_qtype") is None, (path, rule)
    for path in PROJECTIONS:
        assert first_rule(config, path)["weight_qtype"], path


GOOD_RULE = {"module_path": ".*_proj", "weight_qtype": "int8"}
BAD_RULES = {
    "bad regex": ({"module_path": "model/(layers"}, "rules[1].module_path", "bad regex"),
    "unknown qtype": ({**GOOD_RULE, "weight_qtype": "int9"}, "rules[1].weight_qtype",
                      "unknown qtype 'int9'"),
    "unknown act qtype": ({**GOOD_RULE, "act_qtype": "fp8"}, "rules[1].act_qtype",
                          "unknown qtype 'fp8'"),
    "unknown field": ({**GOOD_RULE, "weight_dtype": "int8"}, "rules[1]",
                      "unknown field 'weight_dtype'"),
    "act without weight": ({"module_path": ".*", "act_qtype": "int8"}, "rules[1].act_qtype",
                           "without weight_qtype"),
    "zero tile": ({**GOOD_RULE, "tile_size": 0}, "rules[1].tile_size", "positive integer"),
    "bad calibration": ({**GOOD_RULE, "weight_calibration_method": "median"},
                        "rules[1].weight_calibration_method", "unknown calibration 'median'"),
    "calibration arguments": ({**GOOD_RULE, "weight_calibration_method": "rms"},
                              "rules[1].weight_calibration_method", "rms takes 1..1"),
    "op name": ({**GOOD_RULE, "op_names": ["matmul"]}, "rules[1].op_names", "einsum"),
    "missing path": ({"weight_qtype": "int8"}, "rules[1].module_path", "missing"),
    "static scale": ({**GOOD_RULE, "act_qtype": "int8", "act_static_scale": True},
                     "rules[1].act_static_scale", "random token ids"),
}


@pytest.mark.parametrize("case", BAD_RULES, ids=list(BAD_RULES))
def test_bad_rule_file_names_file_rule_and_field(case, tmp_path):
    rule, where, why = BAD_RULES[case]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"qwix": {"rules": [{"module_path": ".*norm"}, rule]}}))
    with pytest.raises(rules.RulesError) as error:
        rules.load(str(path))
    assert f"{path}: {where}" in str(error.value) and why in str(error.value), str(error.value)


@pytest.mark.parametrize("document, why", [
    ("qwix: {rules: []}", "non-empty list"),
    ("quantization: {qwix: {rules: []}}", "unknown top-level key(s) ['quantization']"),
    ("qwix: {rules: [{module_path: x}], use_abstract_model: true}", "use_abstract_model"),
    ("qwix: {rules: [{module_path: x}], scale: bf16}", "unknown key(s) under qwix: ['scale']"),
    ("qwix: {rules: [[1]]}", "rules[0]: expected a mapping"),
    ("qwix: [", "not valid YAML"),
])
def test_bad_rule_file_structure(document, why, tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(document)
    with pytest.raises(rules.RulesError, match=re.escape(why)):
        rules.load(str(path))


def test_unknown_preset_lists_the_presets():
    with pytest.raises(rules.RulesError, match="int8-weight-only"):
        rules.load("int3-magic")


def additional_config(command: list[str]) -> dict:
    return json.loads(command[command.index("--additional-config") + 1])


def test_quant_flag_passes_rules_as_tpu_inference_additional_config(tmp_path):
    command, _ = build_command(["m", "--quant", "int8", "--additional-config",
                                '{"merge_lora": "/a"}'], {"JAX_PLATFORMS": "cpu"})
    assert additional_config(command) == {"merge_lora": "/a", "quantization": rules.load("int8")}
    own = tmp_path / "mine.yaml"
    own.write_text("qwix:\n  rules:\n    - module_path: '.*mlp/\\w+_proj'\n      weight_qtype: int4\n"
                   "      tile_size: 32\n")
    command, _ = build_command(["m", "--quant", str(own)], {"JAX_PLATFORMS": "cpu"})
    assert additional_config(command)["quantization"] == {"qwix": {"rules": [
        {"module_path": ".*mlp/\\w+_proj", "weight_qtype": "int4", "tile_size": 32}]}}


def test_serve_refuses_a_bad_rules_file_before_starting(tmp_path, monkeypatch):
    from tpu_models.server import serve
    path = tmp_path / "rules.yaml"
    path.write_text("qwix:\n  rules:\n    - module_path: '.*norm'\n"
                    "    - {module_path: '.*_proj', weight_qtype: int9}\n")

    def execvpe(*args):
        raise AssertionError("vllm serve was started")

    monkeypatch.setattr(serve.os, "execvpe", execvpe)
    with pytest.raises(SystemExit) as exit:
        serve.main([str(DEMO), "--quant", str(path)])
    assert str(exit.value.code) == (f"tpu-models serve: {path}: rules[1].weight_qtype: "
                                    "unknown qtype 'int9' (known: " + ", ".join(rules.QTYPES) + ")")


# --- pre-quantized checkpoints: scheme checks ------------------------------------

FP8_DYNAMIC = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "symmetric": True, "dynamic": True}}},
    "ignore": ["lm_head", "structural_head"],
}


def scheme(**group) -> dict:
    return {**FP8_DYNAMIC, "config_groups": {"group_0": {
        **FP8_DYNAMIC["config_groups"]["group_0"], **group}}}


@pytest.mark.parametrize("config, why", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    (scheme(weights={"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}),
     "group_0 (weights int8 channel, input_activations float8 token dynamic)"),
    (scheme(weights={"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
            input_activations=None), "group_0 (weights int4 group(128), input_activations none)"),
    (scheme(weights={"num_bits": 8, "type": "float", "strategy": "tensor"}),
     "weights float8 tensor"),
    (scheme(input_activations={"num_bits": 8, "type": "float", "strategy": "tensor",
                               "dynamic": False}), "input_activations float8 tensor"),
    ({**FP8_DYNAMIC, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
])
def test_unsupported_checkpoint_schemes_are_named(config, why):
    with pytest.raises(prequantized.UnsupportedQuantization, match=re.escape(why)):
        prequantized.check_scheme(config, "ckpt/config.json")


def test_prequantized_table_adds_per_channel_scales_and_refuses_a_quantized_lm_head():
    table = {"model.layers.0.self_attn.q_proj.weight": (64, 32), "model.norm.weight": (32, ),
             "lm_head.weight": (100, 32), "structural_head.weight": (32, 32)}
    assert prequantized.checkpoint_table(table, FP8_DYNAMIC) == {
        **table, "model.layers.0.self_attn.q_proj.weight_scale": (64, 1)}
    with pytest.raises(prequantized.UnsupportedQuantization, match="lm_head is quantized"):
        prequantized.checkpoint_table(table, {**FP8_DYNAMIC, "ignore": ["re:.*structural.*"]})
