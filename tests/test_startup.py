"""Start-up: what a restart repeats, and what waits for the first request."""

import types

import numpy as np
import pytest

from tpu_models import off_tpu
from tpu_models.harness.serve_process import Server
from tests.tiny import Reference, make_qwen3


def test_the_default_kv_budget_does_not_follow_free_memory(monkeypatch):
    """The KV cache's size is in every compiled step's shapes: a budget that moved with
    free memory made each restart miss the JAX cache for the whole model."""
    import psutil

    config = types.SimpleNamespace(kv_cache_memory_bytes=None)

    def budget(total: float, available: float) -> int:
        monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(
            total=int(total * 2**30), available=int(available * 2**30)))
        return off_tpu.kv_cache_budget(config)

    # 20% of the host's memory in whole GiB, whatever else runs beside it ...
    assert budget(23.5, 21.0) == budget(23.5, 14.2) == budget(23.5, 9.5) == 4 * 2**30
    # ... but at most half of what is available, and in 256 MiB steps below 1 GiB
    assert budget(23.5, 5.3) == 2 * 2**30 and budget(23.5, 1.1) == 2 * 2**28
    assert budget(4.0, 3.9) == 3 * 2**28
    config.kv_cache_memory_bytes = 123_456_789
    assert off_tpu.kv_cache_budget(config) == 123_456_789


@pytest.mark.e2e
def test_a_restart_compiles_nothing_and_serves_every_bucket(tmp_path):
    """Cold: the smallest and largest token buckets compile before the server is
    ready, the rest in the background; requests served meanwhile (steps padded to a
    larger bucket) and after give transformers' greedy tokens. Warm: every bucket
    comes from JAX's cache, each is lowered once, and no request lowers one again."""
    model = make_qwen3(tmp_path / "model", num_heads=4, num_kv_heads=2)
    reference = Reference(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, reference.vocab_size, n).tolist() for n in (1, 3, 20, 100, 300)]
    expected = [reference.greedy(p, 6) for p in prompts]
    cache = tmp_path / "xla-cache"
    env = {"VLLM_XLA_CACHE_PATH": str(cache), "SKIP_JAX_PRECOMPILE": "0", "JAX_LOG_COMPILES": "1"}
    args = ("--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
            "--served-model-name", "tiny")

    def steps(name: str) -> list[str]:
        return sorted(p.name for p in cache.iterdir() if p.name.startswith(name))

    with Server(model, *args, log=tmp_path / "cold.log", env=env, settle=False) as cold:
        log = cold.output()
        assert "token buckets [1, 256] compiled; [2, 4, 8, 16, 32, 64, 128] compile in the " \
               "background" in log
        assert "the other token buckets compile in the background" in log  # the ready line
        # ahead of time, on the precompile workers (not "AOT lower skipped ... not a jit")
        assert "AOT lower skipped for worker0 backbone" not in log
        for bucket in (1, 256):
            assert f"Compilation of worker0 backbone --> {{'num_tokens': {bucket}," in log
        assert greedy(cold, prompts) == expected  # some steps padded past uncompiled buckets
        cold.wait_settled()
    compiled = steps("jit_run_model_impl")
    assert len(compiled) == 9  # one program per bucket

    with Server(model, *args, log=tmp_path / "warm.log", env=env) as warm:  # waits for them
        assert greedy(warm, prompts) == expected
        lowered = warm.output().count("jaxpr to MLIR module conversion jit(run_model_impl)")
    assert steps("jit_run_model_impl") == compiled  # nothing compiled on the restart
    assert lowered == 9  # each bucket once, ahead of time: no request lowered one


def greedy(server, prompts, max_tokens=6):
    client = server.client()
    return [client.completions.create(
        model="tiny", prompt=p, max_tokens=max_tokens, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0].token_ids
        for p in prompts]
