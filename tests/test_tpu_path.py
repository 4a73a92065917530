"""The TPU attention path (tpu-inference's RPA backend, its cache layout, its
shard_map over heads), run off-TPU with TPU_MODELS_ATTENTION=rpa-reference: the
kernel body is tpu-inference's own reference of RPA v3, everything around it is
what a TPU runs. Greedy tokens through the real `vllm serve` against transformers."""

import numpy as np
import pytest

from tpu_models import host
from tpu_models.benchmarks.process import Server, launched
from tests.test_serve_e2e import complete_all
from tests.tiny import Reference, make_gemma3, make_qwen3

REFERENCE = {host.ATTENTION_ENV: "rpa-reference"}


def test_an_unknown_or_impossible_attention_path_is_refused_by_name():
    cpu = {"JAX_PLATFORMS": "cpu"}
    assert host.attention_mode(cpu) == "portable" and host.attention_mode({}) == "rpa"
    assert host.attention_mode({**cpu, **REFERENCE}) == "rpa-reference"
    for value, says in [("pallas", "is not an attention path: one of portable"),
                        ("rpa", "needs a TPU"),
                        ("rpa-interpret", "'ReshapeTransform' object has no attribute 'indices'")]:
        with pytest.raises(host.AttentionModeError, match=says):
            host.attention_mode({**cpu, host.ATTENTION_ENV: value})


@pytest.mark.e2e
def test_both_architectures_through_the_rpa_backend_match_transformers(tmp_path):
    """Qwen3-structural, and Gemma 3 with sliding windows (the hybrid KV groups), soft
    caps, chunked prefill of prompts several windows long and a prefix shared by two
    of them (prefix caching)."""
    qwen3 = make_qwen3(tmp_path / "qwen3")
    gemma3 = make_gemma3(tmp_path / "gemma3", sliding_window=16, attn_logit_softcapping=3.0,
                         final_logit_softcapping=20.0)
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 384, 70).tolist()
    prompts = [rng.integers(3, 384, n).tolist() for n in (1, 9, 40)] + \
        [shared + rng.integers(3, 384, 30).tolist(), shared + rng.integers(3, 384, 45).tolist()]
    common = ("--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
              "--kv-cache-memory-bytes", str(32 << 20), "--served-model-name", "tiny")
    servers = {name: Server(path, *common, log=tmp_path / f"{name}.log", env=REFERENCE)
               for name, path in (("qwen3", qwen3), ("gemma3", gemma3))}
    with launched(servers):
        for name, server in servers.items():
            server.start()
            assert "attention rpa-reference" in server.output(), name  # the ready line
            got = complete_all(server, prompts, max_tokens=6)
            reference = Reference(qwen3 if name == "qwen3" else gemma3)
            for prompt, ids in zip(prompts, got):
                assert ids == reference.greedy(prompt, 6), f"{name}: prompt of {len(prompt)}"
            assert "ragged_paged_attention" not in server.output()  # no kernel error logged


def test_tpu_models_serve_refuses_an_attention_path_it_cannot_run(tmp_path):
    server = Server(None, log=tmp_path / "serve.log",
                    env={host.ATTENTION_ENV: "rpa-interpret"})
    assert server.wait_exit(60) != 0
    assert "TPU_MODELS_ATTENTION=rpa-interpret cannot run" in server.output()
