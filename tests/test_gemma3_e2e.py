"""Gemma 3 end to end through the real `vllm serve --dtype float32`."""

import numpy as np
import pytest

from tpu_models.harness.serve_process import Server
from tests.test_serve_e2e import MAX_TOKENS, complete_all
from tests.tiny import Reference, make_gemma3, make_lora

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_gemma3(tmp_path_factory.mktemp("gemma3"), sliding_window=16)


def prompts_longer_than_the_window(vocab):
    rng = np.random.default_rng(3)
    return [rng.integers(0, vocab, n).tolist() for n in (5, 17, 60, 61, 130)]


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_concurrent_greedy_matches_transformers(gemma3, lora, tmp_path):
    adapter = make_lora(gemma3, tmp_path / "adapter", use_rslora=True) if lora else None
    reference = Reference(gemma3, adapter=adapter)
    prompts = prompts_longer_than_the_window(reference.vocab_size)
    args = ["--lora", str(adapter)] if lora else []
    with Server(gemma3, "--dtype", "float32", "--max-model-len", "512", *args,
                "--kv-cache-memory-bytes", "67108864", "--served-model-name", "tiny",
                log=tmp_path / "serve.log") as s:
        if lora:
            assert "merging LoRA" in s.output()
        got = complete_all(s, prompts)
    for prompt, ids in zip(prompts, got):
        assert ids == reference.greedy(prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
