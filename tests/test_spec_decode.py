"""Speculative decoding with n-gram prompt lookup is lossless on our models:
the same greedy tokens as without it, 16 requests at once, while vLLM counts
accepted draft tokens.

Not here: guided decoding with speculation. tpu-inference 0.32.0 applies one
grammar-bitmask row per request (StructuredDecodingManager), while vLLM sends
one per request *and draft position*; with drafts, later requests get another
request's rows and the grammar rejects their tokens (HTTP 500). Issue #19."""

import asyncio
import json

import numpy as np
import pytest

from benchmarks import serving
from benchmarks.demo_data import held_out
from server.process import Server
from server.serve import DEFAULT_NAME
from tests.test_serve_e2e import complete_all
from tests.tiny import Reference, make_gemma3

pytestmark = pytest.mark.e2e

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2})
CONCURRENT = 16


def accepted_draft_tokens(server) -> float:
    accepted = "vllm:spec_decode_num_accepted_tokens_total"
    return serving.server_counters(server.url, [accepted])[accepted]


def chat_answers(server, examples) -> list[str]:

    async def answer(client, example):
        reply = await client.chat.completions.create(
            model=DEFAULT_NAME, messages=[{"role": "user", "content": example["request"]}],
            temperature=0.0, max_tokens=64)
        return reply.choices[0].message.content

    async def run():
        client = server.async_client()
        return await asyncio.gather(*[answer(client, e) for e in examples])

    return asyncio.run(run())


def test_ngram_on_the_demo_gives_the_tokens_of_plain_decoding(demo_server, tmp_path):
    """JSON extraction copies the request's words: where n-gram lookup pays."""
    examples = held_out(CONCURRENT, novel=True)
    with Server(None, "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
                "--speculative-config", NGRAM, log=tmp_path / "serve.log") as speculative:
        assert chat_answers(speculative, examples) == chat_answers(demo_server, examples)
        assert accepted_draft_tokens(speculative) > 0


def test_ngram_on_gemma3_matches_transformers(tmp_path):
    model = make_gemma3(tmp_path / "gemma3", sliding_window=16)
    reference = Reference(model)
    rng = np.random.default_rng(11)
    # Repeated spans give the lookup something to propose.
    prompts = []
    for n in rng.integers(4, 40, CONCURRENT):
        span = rng.integers(0, reference.vocab_size, n).tolist()
        prompts.append(span * 3)
    with Server(model, "--dtype", "float32", "--max-model-len", "512",
                "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "tiny",
                "--speculative-config", NGRAM, log=tmp_path / "serve.log") as s:
        got = complete_all(s, prompts, max_tokens=24)
        assert accepted_draft_tokens(s) > 0
    for prompt, ids in zip(prompts, got):
        assert ids == reference.greedy(prompt, 24), f"prompt of {len(prompt)} tokens"
