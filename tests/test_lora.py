"""LoRA merged while loading (and offline) vs peft's merge_and_unload (fp32)."""

import json
import shutil

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from tpu_models.loaders.exporter import convert as export
from tpu_models.loaders.hf import CheckpointError, HfCheckpoint
from tpu_models.loaders.peft import LoraAdapter
from tpu_models import registry
from tpu_models.harness.stepper import Stepper
from tests.test_gemma3 import run_steps
from tests.tiny import Reference, check_exactly, make_lora, make_qwen3


def steps_for(vocab, seed=0):
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, vocab, 40).tolist(), rng.integers(0, vocab, 23).tolist()
    return [{"a": a, "b": b[:9]}, {"a": [1], "b": b[9:]}, {"b": [2], "a": [3]}]


@pytest.mark.parametrize("model,lora", [
    ("qwen3", dict()),  # every projection, alpha / r
    ("gemma3", dict(targets=("q_proj", "v_proj", "down_proj"), use_rslora=True, r=8)),
])
def test_merged_on_load_matches_peft(model, lora, request, tmp_path):
    base = request.getfixturevalue(model)
    adapter = make_lora(base, tmp_path / "adapter", **lora)
    reference = Reference(base, adapter=adapter)
    stepper = Stepper(base, additional_config={"merge_lora": str(adapter)})
    worst = run_steps(stepper, reference, steps_for(reference.vocab_size))
    # The adapter must matter: the base model is far from the merged one (1000x the 1e-4).
    base_logits = Reference(base).logits(steps_for(reference.vocab_size)[0]["a"])
    assert np.abs(base_logits - reference.logits(steps_for(reference.vocab_size)[0]["a"])).max() > 0.1
    print(f"{model}: max |logit diff| vs peft merge_and_unload: {worst:.2e}")


def test_offline_merge_writes_a_checkpoint_equal_to_peft(qwen3, tmp_path):
    adapter = make_lora(qwen3, tmp_path / "adapter", targets=("k_proj", "up_proj"))
    out = export.lora_merge(qwen3, adapter, tmp_path / "merged",
                            arch=registry.for_checkpoint(qwen3))
    merged = HfCheckpoint(out)
    config = json.loads((out / "config.json").read_text())
    table, optional = registry.for_config(config).hf_table(config)
    check_exactly(merged, table, optional=optional)
    assert (out / "tokenizer.json").exists()
    reference = Reference(qwen3, adapter=adapter)
    worst = run_steps(Stepper(out), reference, steps_for(reference.vocab_size, seed=1))
    print(f"offline merge: max |logit diff| vs peft: {worst:.2e}")
    with pytest.raises(CheckpointError, match="already exists"):
        export.lora_merge(qwen3, adapter, out, arch=registry.for_checkpoint(qwen3))


def edit_adapter(adapter, *, config=None, tensors=None):
    if config:
        path = adapter / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors:
        weights = load_file(adapter / "adapter_model.safetensors")
        tensors(weights)
        save_file(weights, adapter / "adapter_model.safetensors")
    return adapter


@pytest.fixture(scope="module")
def good_adapter(qwen3, tmp_path_factory):
    return make_lora(qwen3, tmp_path_factory.mktemp("lora") / "adapter", targets=("q_proj",))


def copy(adapter, tmp_path):
    return shutil.copytree(adapter, tmp_path / "adapter")


def renamed(old, new):
    def edit(weights):
        for key in [k for k in weights if old in k]:
            weights[key.replace(old, new)] = weights.pop(key)
    return edit


@pytest.mark.parametrize("edit,message", [
    (dict(config={"use_dora": True}), "use_dora=True is not supported"),
    (dict(config={"bias": "lora_only"}), "bias='lora_only' is not supported"),
    (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (dict(tensors=renamed("layers.1.", "layers.7.")),
     "targets model.layers.7.self_attn.q_proj.weight, which the base checkpoint does not have"),
    (dict(tensors=renamed("q_proj", "embed_proj")), "supported targets: q_proj"),
    (dict(tensors=lambda w: w.pop(next(k for k in w if "lora_B" in k))), "but not both A and B"),
])
def test_bad_adapters_are_refused_naming_the_fault(good_adapter, qwen3, tmp_path, edit, message):
    adapter = edit_adapter(copy(good_adapter, tmp_path), **edit)
    with pytest.raises(CheckpointError, match=message):
        config = json.loads((qwen3 / "config.json").read_text())
        LoraAdapter(adapter).check_base(registry.for_config(config).hf_table(config)[0])


def test_adapter_for_another_base_stops_loading(good_adapter, tmp_path):
    other = make_qwen3(tmp_path / "wide", hidden_size=96, num_heads=4, num_kv_heads=2)
    with pytest.raises(CheckpointError, match="B @ A is \\[64, 64\\] but the base weight is "
                       "\\[64, 96\\]"):
        Stepper(other, additional_config={"merge_lora": str(good_adapter)})


def test_missing_adapter_files_are_named(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(CheckpointError, match="no adapter_model.safetensors"):
        LoraAdapter(tmp_path)
    with pytest.raises(CheckpointError, match="no adapter_config.json"):
        LoraAdapter(tmp_path / "nowhere")
