"""Data parallelism, the layout users pick on a v6e-8 for a small model: one engine
per data-parallel rank, each with its own mesh (tensor parallel inside), on fake
CPU devices. Greedy tokens equal transformers' (so equal to one rank's), and
concurrent requests are served by both ranks."""

import re

import numpy as np
import pytest
import requests

from tpu_models.harness.serve_process import Server
from tests.test_serve_e2e import complete_all
from tests.test_tensor_parallel import FOUR_DEVICES
from tests.tiny import Reference, make_gemma3, make_qwen3

pytestmark = pytest.mark.e2e


def served_by_engine(server) -> dict[str, float]:
    """Requests each data-parallel engine finished, from vLLM's /metrics."""
    counts = {}
    for line in requests.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        found = re.match(r'vllm:request_success_total\{engine="(\d+)".*\} ([\d.]+)', line)
        if found:
            counts[found[1]] = counts.get(found[1], 0.0) + float(found[2])
    return counts


def test_two_ranks_give_the_tokens_of_one_and_share_the_requests(tmp_path):
    qwen3 = make_qwen3(tmp_path / "qwen3")
    gemma3 = make_gemma3(tmp_path / "gemma3", sliding_window=16)  # one KV head, repeated per shard
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 384, n).tolist() for n in (2, 11, 40, 75)]
    common = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes",
              str(32 << 20), "--served-model-name", "tiny", "--data-parallel-size", "2")
    servers = {
        "qwen3 dp2": Server(qwen3, *common, log=tmp_path / "qwen3.log"),
        # Prompts up to 5 windows of the local layers, prefilled in chunks of 32.
        "gemma3 dp2 tp2": Server(gemma3, *common, "--tensor-parallel-size", "2",
                                 "--max-num-batched-tokens", "32", "--max-num-seqs", "16",
                                 log=tmp_path / "gemma3.log", env=FOUR_DEVICES)}
    for name, server in servers.items():
        # One after the other: each is five processes of about 1 GB (two API servers,
        # two engines, the coordinator), and the suite's other worker runs servers too.
        with server:
            if "tp2" in name:  # each rank's own mesh: two devices for the model
                assert "Mesh('data': 1, 'model': 2" in server.output()
                assert "num_kv_cache_groups=6" in server.output()  # the hybrid KV cache, sharded
            reference = Reference(qwen3 if name.startswith("qwen3") else gemma3)
            got = complete_all(server, prompts * 4, max_tokens=6)  # 16 at once
            for prompt, ids in zip(prompts * 4, got):
                assert ids == reference.greedy(prompt, 6), f"{name}: prompt of {len(prompt)}"
            by_engine = served_by_engine(server)
            assert sorted(by_engine) == ["0", "1"] and min(by_engine.values()) > 0, by_engine
