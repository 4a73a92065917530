"""Start-up: what a restart repeats, and what waits for the first request."""

import time
import types

import numpy as np
import pytest

from tpu_models.adapt import host_portability
from tpu_models.benchmarks.process import Server
from tests.tiny import Reference, make_qwen3


def test_the_default_kv_budget_does_not_follow_free_memory_to_the_byte(monkeypatch):
    """The KV cache's size is in every compiled step's shapes: a budget that moved with
    free memory made each restart miss the JAX cache for the whole model."""
    import psutil

    config = types.SimpleNamespace(kv_cache_memory_bytes=None)
    budgets = {}
    for available in (21.0, 21.7, 24.9, 4.3, 1.1):
        monkeypatch.setattr(psutil, "virtual_memory",
                            lambda a=available: types.SimpleNamespace(available=int(a * 2**30)))
        budgets[available] = host_portability.kv_cache_budget(config)
    assert budgets[21.0] == budgets[21.7] == budgets[24.9] == 4 * 2**30  # 20%, whole GiB
    assert budgets[4.3] == 3 * 2**28 and budgets[1.1] == 2**28  # below 1 GiB: 256 MiB steps
    config.kv_cache_memory_bytes = 123_456_789
    assert host_portability.kv_cache_budget(config) == 123_456_789


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

    with Server(model, *args, log=tmp_path / "cold.log", env=env) as cold:
        log = cold.output()
        assert "token buckets [1, 256] compiled; [2, 4, 8, 16, 32, 64, 128] compile in the " \
               "background" in log
        assert "the other token buckets compile in the background" in log  # the ready line
        # ahead of time, on the precompile workers (not "AOT lower skipped ... not a jit")
        assert "AOT lower skipped for worker0 backbone" not in log
        for bucket in (1, 256):
            assert f"Compilation of worker0 backbone --> {{'num_tokens': {bucket}," in log
        assert greedy(cold, prompts) == expected  # some steps padded past uncompiled buckets
        wait_for(lambda: "all token buckets compiled" in cold.output())
    compiled = steps("jit_run_model_impl")
    assert len(compiled) == 9  # one program per bucket

    with Server(model, *args, log=tmp_path / "warm.log", env=env) as warm:
        wait_for(lambda: "all token buckets compiled" in warm.output())
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


def wait_for(condition, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def test_serve_and_the_benchmark_harness_send_no_usage_statistics():
    """vLLM posts usage statistics to its own server by default."""
    from tpu_models.server.serve import build_command

    assert build_command([], {})[1]["VLLM_NO_USAGE_STATS"] == "1"
    assert build_command([], {"VLLM_NO_USAGE_STATS": "0"})[1]["VLLM_NO_USAGE_STATS"] == "0"
    server = Server(None, log=None)
    assert server.env["VLLM_NO_USAGE_STATS"] == "1" and server.env["DO_NOT_TRACK"] == "1"
