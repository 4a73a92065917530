"""Tunix checkpoints -> HF: the exported model computes what Tunix computed.

Fixtures (tests/fixtures/tunix) come from Tunix's own PeftTrainer (one step on
random tokens, full fine-tune and qwix LoRA), with the logits of Tunix's own
forward pass: see tests/fixtures/tunix/README.md.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tpu_models.loaders.exporter import convert as export
from tpu_models.loaders.hf import CheckpointError, HfCheckpoint
from tpu_models import registry
from tpu_models.harness.stepper import Stepper
from tests.tiny import Reference, make_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "tunix"
VARIANTS = ["gemma3", "gemma3_mha", "qwen3_tied", "qwen3_untied_sharded4"]


def tunix(checkpoint, base, out, **options):
    """The exporter, with the architecture the CLI would look up from --base."""
    return export.tunix(checkpoint, base, out, arch=registry.for_checkpoint(base), **options)


def hf_config_dir(variant: str, tmp_path: Path) -> Path:
    """The HF side of the run: config.json (from the fixture) and a tokenizer."""
    base = tmp_path / "base-config"
    base.mkdir(parents=True)
    shutil.copy(FIXTURES / variant / "hf_config" / "config.json", base)
    make_tokenizer(base, 384)
    return base


def fixture(variant):
    meta = json.loads((FIXTURES / variant / "meta.json").read_text())
    tokens = np.load(FIXTURES / variant / "tokens.npy").reshape(-1).tolist()
    return meta, tokens


def served_logits(checkpoint: Path, tokens: list[int]) -> np.ndarray:
    """Logits of the exported checkpoint as served (tpu-inference's loading and step path).

    Plain Qwen3 checkpoints go to tpu-inference's built-in Qwen3ForCausalLM, which
    pads head_dim to 128 and then cannot load the q/k norms of these fixtures'
    head_dim 16; for those, transformers (fp32) computes the reference side.
    """
    config = json.loads((checkpoint / "config.json").read_text())
    if config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] % 64:
        return Reference(checkpoint).logits(tokens)
    return Stepper(checkpoint).step({"a": tokens})["a"][:, :384]


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_and_lora_exports_compute_what_tunix_computed(variant, tmp_path):
    meta, tokens = fixture(variant)
    full = tunix(FIXTURES / variant / "full_ckpt", hf_config_dir(variant, tmp_path),
                 tmp_path / "full")
    got = served_logits(full, tokens)
    want = np.load(FIXTURES / variant / "full_logits.npy")[0]
    # fp32 logits, Tunix's XLA forward (fixture) vs ours: reduction order differs, 1e-4 on O(1)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    alpha = meta["lora"]["alpha"]
    merged = tunix(FIXTURES / variant / "lora_ckpt", full, tmp_path / "merged", lora_alpha=alpha)
    got = served_logits(merged, tokens)
    want_lora = np.load(FIXTURES / variant / "lora_logits.npy")[0]
    np.testing.assert_allclose(got, want_lora, atol=1e-4, rtol=0)  # fp32, as above
    assert np.abs(want_lora - want).max() > 0.01  # the adapter changes the model: 100x the 1e-4

    # The same LoRA as a PEFT adapter: peft itself reproduces Tunix's LoRA model (fp32, 1e-4).
    adapter = tunix(FIXTURES / variant / "lora_ckpt", full, tmp_path / "adapter",
                    lora_alpha=alpha, adapter_only=True)
    np.testing.assert_allclose(Reference(full, adapter=adapter).logits(tokens), want_lora,
                               atol=1e-4, rtol=0)


def test_cli_and_bfloat16_output(tmp_path):
    base = hf_config_dir("qwen3_tied", tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "tpu_models.server.cli", "export", "tunix",
         str(FIXTURES / "qwen3_tied" / "full_ckpt"), "--base", str(base), "--out",
         str(tmp_path / "out"), "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    checkpoint = HfCheckpoint(tmp_path / "out")
    assert {i.dtype for i in checkpoint.tensors.values()} == {"BF16"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_lora_needs_alpha(tmp_path):
    with pytest.raises(CheckpointError, match="stores no alpha; pass --lora-alpha"):
        tunix(FIXTURES / "qwen3_tied" / "lora_ckpt", hf_config_dir("qwen3_tied", tmp_path),
              tmp_path / "out")
    assert not (tmp_path / "out").exists()


def save_tunix_tree(directory: Path, tree: dict) -> Path:
    """A tree in Tunix's trainer layout: <root>/<step>/model_params, NNX paths ending in
    'value' (tunix/sft/checkpoint_manager.py saves nnx.state(model) with orbax's
    PyTreeCheckpointHandler; qwix names LoRA params <weight>_lora_a/_lora_b)."""
    def wrap(node):
        return {k: wrap(v) for k, v in node.items()} if isinstance(node, dict) else {"value": node}

    ocp.PyTreeCheckpointer().save((directory / "1" / "model_params").absolute(), wrap(tree))
    return directory


def test_lora_rank_mismatch_is_named(tmp_path):
    rng = np.random.default_rng(0)
    tree = {"layers": {"0": {"attn": {"q_proj": {
        "w_lora_a": rng.normal(size=(64, 4)).astype(np.float32),
        "w_lora_b": rng.normal(size=(3, 4, 16)).astype(np.float32)}}}}}
    ckpt = save_tunix_tree(tmp_path / "lora", tree)
    with pytest.raises(CheckpointError, match="layers/0/attn/q_proj/w: lora_a \\[64, 4\\] and "
                       "lora_b \\[3, 4, 16\\] disagree on the rank"):
        tunix(ckpt, hf_config_dir("qwen3_tied", tmp_path), tmp_path / "out", lora_alpha=8)
    assert not (tmp_path / "out").exists()


def test_config_with_more_layers_names_the_missing_tensors(tmp_path):
    base = hf_config_dir("qwen3_tied", tmp_path)
    config = json.loads((base / "config.json").read_text())
    config.update(num_hidden_layers=3, layer_types=["full_attention"] * 3)
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing tensor layers/2/attn/q_proj/w \\(for "
                       "model.layers.2.self_attn.q_proj.weight\\)"):
        tunix(FIXTURES / "qwen3_tied" / "full_ckpt", base, tmp_path / "out")


def test_wrong_shape_and_existing_output_are_refused_untouched(tmp_path):
    base = hf_config_dir("qwen3_tied", tmp_path)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match="tensor layers/0/mlp/gate_proj/kernel \\[64, 128\\] "
                       "gives model.layers.0.mlp.gate_proj.weight of shape \\[128, 64\\], "
                       "config.json implies \\[96, 64\\]"):
        tunix(FIXTURES / "qwen3_tied" / "full_ckpt", base, tmp_path / "out")
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        tunix(FIXTURES / "qwen3_tied" / "full_ckpt", hf_config_dir("gemma3", tmp_path / "g"), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_damaged_checkpoint_names_the_tensor_and_leaves_nothing(tmp_path):
    damaged = shutil.copytree(FIXTURES / "qwen3_tied" / "full_ckpt", tmp_path / "damaged")
    for data in (damaged / "1" / "model_params").rglob("d/*"):
        data.write_bytes(data.read_bytes()[:16])  # truncated chunks
    with pytest.raises(CheckpointError, match="damaged/1/model_params: cannot read"):
        tunix(damaged, hf_config_dir("qwen3_tied", tmp_path), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
