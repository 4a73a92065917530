"""Multimodal Gemma 3 checkpoints: served text-only after `tpu-models export gemma3-text`."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from tpu_models.harness.stepper import Stepper
from tests.tiny import make_tokenizer


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                              SiglipVisionConfig)

    directory = tmp_path_factory.mktemp("gemma3-mm")
    make_tokenizer(directory)
    text = Gemma3TextConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                            head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
                            initializer_range=0.08)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=380, boi_token_index=381,
                          eoi_token_index=382)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(directory)
    return directory, model


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "tpu_models.server.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_serve_refuses_with_the_command_that_fixes_it(multimodal):
    directory, _ = multimodal
    result = run_cli("serve", str(directory), "--dry-run")
    assert result.returncode != 0
    assert "multimodal checkpoint (Gemma3ForConditionalGeneration)" in result.stderr
    assert f"tpu-models export gemma3-text {directory}" in result.stderr


def test_extracted_language_model_serves_like_the_multimodal_one(multimodal, tmp_path):
    directory, model = multimodal
    out = tmp_path / "text"
    result = run_cli("export", "gemma3-text", str(directory), "--out", str(out))
    assert result.returncode == 0, result.stderr
    ids = np.random.default_rng(0).integers(0, 380, 40).tolist()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    got = Stepper(out).step({"a": ids})["a"][:, :384]
    # fp32 logits vs transformers fp32: reduction order differs, 1e-4 absolute on O(1) logits
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
