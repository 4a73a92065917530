"""Gemma 3's local layers keep only their window of KV pages (vLLM's hybrid KV
cache manager on the flax_nnx path, tpu_models.adapt.kv_cache), and still give
transformers' greedy tokens: long prompts, long generations, a reused prefix,
chunked prefill and a 30,000-token prompt, through the real `vllm serve`."""

import numpy as np
import pytest

from tpu_models.benchmarks import serving
from tpu_models.harness.serve_process import Server, launched
from tests.test_serve_e2e import complete_all
from tests.tiny import Reference, make_gemma3, make_qwen3

pytestmark = pytest.mark.e2e

WINDOW = 16
LONG_CONTEXT = 32768
CHUNK = 128  # --max-num-batched-tokens: prompts past it are prefilled in chunks


@pytest.fixture(scope="module")
def gemma3_32k(tmp_path_factory):
    # 5 local layers (window 16), then a global one
    return make_gemma3(tmp_path_factory.mktemp("gemma3"), sliding_window=WINDOW,
                       max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module")
def reference(gemma3_32k):
    return Reference(gemma3_32k)


@pytest.fixture(scope="module")
def server(gemma3_32k, tmp_path_factory):
    with Server(gemma3_32k, "--dtype", "float32", "--max-model-len", str(LONG_CONTEXT),
                "--max-num-batched-tokens", str(CHUNK), "--kv-cache-memory-bytes", str(128 << 20),
                "--served-model-name", "tiny",
                log=tmp_path_factory.mktemp("logs") / "serve.log") as s:
        yield s


def prompts(rng, vocab, lengths):
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def test_local_layers_get_their_own_kv_cache_groups(server):
    log = server.output()
    # one group per layer position: 5 local (window) groups and 1 global
    assert "num_kv_cache_groups=6" in log
    # ... overlaid in one allocation, the pool vLLM sized
    assert "num_total_layers=1 " in log
    tokens, concurrency = server.kv_capacity()
    # vLLM logs int(concurrency * max_model_len) and concurrency as %.2f: <= 0.005 off, and
    # the token count is truncated by < 1
    assert concurrency * LONG_CONTEXT == pytest.approx(tokens, abs=0.005 * LONG_CONTEXT + 1)


def test_prompts_of_ten_windows_and_generations_of_many(server, reference):
    rng = np.random.default_rng(5)
    batch = prompts(rng, reference.vocab_size, (10 * WINDOW, 13 * WINDOW, 3, WINDOW + 1))
    got = complete_all(server, batch, max_tokens=6 * WINDOW)
    for prompt, ids in zip(batch, got):
        assert ids == reference.greedy(prompt, 6 * WINDOW), f"prompt of {len(prompt)} tokens"


def prefix_cache_hits(server) -> float:
    hits = "vllm:prefix_cache_hits_total"
    return serving.server_counters(server.url, [hits])[hits]


def test_a_long_prefix_is_reused_from_the_prefix_cache(server, reference):
    rng = np.random.default_rng(6)
    prefix = prompts(rng, reference.vocab_size, [20 * WINDOW])[0]
    first, *later = [prefix + tail for tail in prompts(rng, reference.vocab_size, (7, 9, 11))]
    complete_all(server, [first], max_tokens=1)
    hits = prefix_cache_hits(server)
    got = complete_all(server, later, max_tokens=2 * WINDOW)  # concurrently, after `first`
    # each reuses all of the prefix's whole pages
    assert prefix_cache_hits(server) - hits >= len(later) * (len(prefix) // 32 - 1) * 32
    for prompt, ids in zip(later, got):
        assert ids == reference.greedy(prompt, 2 * WINDOW)


def test_penalties_over_a_prompt_prefilled_in_chunks_and_then_cached(server, reference):
    """The repetition penalty reads the whole prompt, prefilled in 4 chunks (tokens
    sampled mid-prompt are discarded, not counted), then again from the prefix cache;
    the frequency and presence penalties read the output the device counted."""
    from tests.test_sampler import decisive_greedy
    rng = np.random.default_rng(12)
    prompt = prompts(rng, reference.vocab_size, [3 * CHUNK + 70])[0]
    penalties = {"repetition_penalty": 1.4, "frequency_penalty": 0.6, "presence_penalty": 0.4}
    want = decisive_greedy(reference, prompt, 12, **penalties)
    assert want != reference.greedy(prompt, 12)
    hits = prefix_cache_hits(server)
    for _ in range(2):
        reply = server.client().completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **penalties})
        assert [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens] == want
    assert prefix_cache_hits(server) - hits >= 3 * CHUNK  # the second prompt's whole pages


def test_a_30000_token_prompt_beside_short_requests(server, reference):
    rng = np.random.default_rng(7)
    long_prompt, *short = prompts(rng, reference.vocab_size, (30_000, 40, 200))
    got_long, *got_short = complete_all(server, [long_prompt, *short], max_tokens=4)
    assert got_long == reference.greedy_cached(long_prompt, 4)
    for prompt, ids in zip(short, got_short):
        assert ids == reference.greedy(prompt, 4)


def test_qwen3_structural_with_sliding_layers(tmp_path):
    model = make_qwen3(tmp_path / "qwen3-structural", num_layers=4, sliding_window=WINDOW,
                       layer_types=["sliding_attention", "full_attention"] * 2)
    reference = Reference(model)
    batch = prompts(np.random.default_rng(8), reference.vocab_size, (10 * WINDOW, 40, 3))
    with Server(model, "--dtype", "float32", "--max-model-len", "1024",
                "--max-num-batched-tokens", str(CHUNK), "--kv-cache-memory-bytes", str(64 << 20),
                "--served-model-name", "tiny", log=tmp_path / "serve.log") as s:
        assert "num_kv_cache_groups=2" in s.output()
        got = complete_all(s, batch, max_tokens=4 * WINDOW)
    for prompt, ids in zip(batch, got):
        assert ids == reference.greedy(prompt, 4 * WINDOW), f"prompt of {len(prompt)} tokens"


def test_disabling_the_hybrid_manager_costs_gemma3_1b_most_of_its_capacity(tmp_path):
    """Gemma 3 1B's attention (26 layers, 22 local with window 512, 1 KV head of
    256) at 32K context: vLLM's reported concurrency with and without the
    hybrid manager, same KV-cache bytes (small MLP and vocabulary: they do not
    change the KV cache). vLLM reserves each local layer its window plus the
    tokens two in-flight steps may schedule: 1024 per step here, the default
    of `vllm serve` on a TPU v6e."""
    model = make_gemma3(tmp_path / "gemma3-1b-attention", num_layers=26, num_heads=4,
                        num_kv_heads=1, head_dim=256, sliding_window=512,
                        max_position_embeddings=LONG_CONTEXT)
    servers = {mode: Server(model, "--dtype", "float32", "--max-model-len", str(LONG_CONTEXT),
                            "--max-num-batched-tokens", "1024", "--kv-cache-memory-bytes",
                            str(2 << 30), *args, log=tmp_path / f"{mode}.log")
               for mode, args in (("hybrid", ()),
                                  ("disabled", ("--disable-hybrid-kv-cache-manager",)))}
    with launched(servers):  # both at once: each is stopped once vLLM has sized its KV cache
        capacity = {mode: server.kv_capacity() for mode, server in servers.items()}
    ratio = capacity["hybrid"][1] / capacity["disabled"][1]
    print(f"max concurrency at 32K: hybrid {capacity['hybrid'][1]:.2f}, "
          f"disabled {capacity['disabled'][1]:.2f}, ratio {ratio:.2f}")
    assert ratio >= 4
