"""Gemma 3 end to end through the real `vllm serve --dtype float32` (conftest's shared
gemma3_server), and with an adapter merged at load."""

import numpy as np
import pytest

from tpu_models.harness.serve_process import Server
from tests.test_serve_e2e import MAX_TOKENS, complete_all
from tests.tiny import Reference, make_lora

pytestmark = pytest.mark.e2e


def prompts_longer_than_the_window(vocab):
    rng = np.random.default_rng(3)
    return [rng.integers(0, vocab, n).tolist() for n in (5, 17, 60, 61, 130)]


def test_concurrent_greedy_matches_transformers(gemma3_server, gemma3_ascii):
    reference = Reference(gemma3_ascii)
    prompts = prompts_longer_than_the_window(reference.vocab_size)
    got = complete_all(gemma3_server, prompts)
    for prompt, ids in zip(prompts, got):
        assert ids == reference.greedy(prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


def test_an_adapter_merged_at_load_matches_peft(gemma3_ascii, tmp_path):
    adapter = make_lora(gemma3_ascii, tmp_path / "adapter", use_rslora=True)
    reference = Reference(gemma3_ascii, adapter=adapter)
    prompts = prompts_longer_than_the_window(reference.vocab_size)
    with Server(gemma3_ascii, "--dtype", "float32", "--max-model-len", "512", "--lora",
                str(adapter), "--kv-cache-memory-bytes", "67108864", "--served-model-name",
                "tiny", log=tmp_path / "serve.log") as s:
        assert "merging LoRA" in s.output()
        got = complete_all(s, prompts)
    for prompt, ids in zip(prompts, got):
        assert ids == reference.greedy(prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
