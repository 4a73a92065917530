"""Qwen3-structural through tpu-inference's loading and step path vs transformers (fp32)."""

import numpy as np
import pytest

from tpu_models.harness.stepper import Stepper
from tests.tiny import Reference, make_qwen3, reshard

CONFIGS = {
    "untied-gqa2": dict(tied=False, num_heads=4, num_kv_heads=2, head_dim=16),
    "tied-gqa4": dict(tied=True, num_heads=8, num_kv_heads=2, head_dim=32, attention_bias=True),
    "untied-mha-sharded": dict(tied=False, num_heads=4, num_kv_heads=4, head_dim=16),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    directory = make_qwen3(tmp_path_factory.mktemp(request.param), **CONFIGS[request.param])
    return reshard(directory) if request.param.endswith("sharded") else directory


def test_logits_match_transformers_through_paged_cache(checkpoint):
    """Ragged prefill, then mixed decode/chunked-prefill steps crossing page boundaries."""
    rng = np.random.default_rng(0)
    reference = Reference(checkpoint)
    vocab = reference.vocab_size
    stepper = Stepper(checkpoint, page_size=16)
    prompts = {name: list(rng.integers(0, vocab, n)) for name, n in
               [("a", 5), ("b", 37), ("c", 1), ("d", 20)]}
    steps = [
        {"b": prompts["b"], "a": prompts["a"], "d": prompts["d"][:7], "c": prompts["c"]},
        # decodes first, a chunked-prefill continuation, and a new request
        {"a": [3], "c": [9], "b": [11], "d": prompts["d"][7:], "e": list(rng.integers(0, vocab, 18))},
        {"e": [1], "a": [4], "b": [5], "c": [6], "d": [7]},
        {"d": [8], "e": [2], "b": [5]},
    ]
    seen = {}
    worst = 0.0
    for step in steps:
        got = stepper.step(step)
        for name, tokens in step.items():
            seen[name] = seen.get(name, []) + list(tokens)
            want = reference.logits(seen[name])[-len(tokens):]
            # fp32 logits vs transformers fp32: reduction order differs, 1e-4 absolute on O(1)
            np.testing.assert_allclose(got[name][:, :vocab], want, atol=1e-4, rtol=0,
                                       err_msg=f"request {name}")
            worst = max(worst, float(np.abs(got[name][:, :vocab] - want).max()))
    print(f"max |logit diff| vs transformers: {worst:.2e}")
