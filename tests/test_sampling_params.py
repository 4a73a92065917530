"""The OpenAI sampling surface on the demo (tpu_models/adapt/sampling.py): a parameter
tpu-inference's sampler would ignore gets a 400 naming it, streamed or not, and the
server keeps serving; logprobs=0 is served with transformers' values; a checkpoint's
default penalty is applied."""

import json

import numpy as np
import pytest
import requests

from tpu_models.server.serve import DEFAULT_MODEL, DEFAULT_NAME

pytestmark = pytest.mark.e2e

# Request field -> a value that asks the sampler for something it does not do.
IGNORED = {"logprob_token_ids": [5], "thinking_token_budget": 8}
ENDPOINTS = {
    "completions": {"prompt": "Bob is 30"},
    "chat/completions": {"messages": [{"role": "user", "content": "Bob is 30"}]},
}


def post(server, endpoint, body, stream=False):
    return requests.post(f"{server.url}/v1/{endpoint}", timeout=120, headers=server.headers(),
                         json={"model": DEFAULT_NAME, "max_tokens": 8, "temperature": 1.0,
                               "stream": stream, **ENDPOINTS[endpoint], **body})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_parameters_the_sampler_ignores_get_a_400_naming_them(demo_server, endpoint, stream):
    for name, value in IGNORED.items():
        response = post(demo_server, endpoint, {name: value}, stream)
        assert response.status_code == 400, (name, response.status_code, response.text[:500])
        error = response.json()["error"]
        assert error["param"] == name and name in error["message"], (name, error)
    # Neutral values are no request for anything: served.
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
               "temperature": 0}
    response = post(demo_server, endpoint, neutral, stream)
    assert response.status_code == 200, response.text[:500]


def test_allowed_token_ids_no_longer_kills_the_engine(demo_server):
    # It crashed tpu-inference's input batch; every later request got 500.
    for _ in range(2):
        reply = post(demo_server, "completions", {"allowed_token_ids": [5, 6]})
        assert reply.status_code == 200, reply.text[:500]
    reply = demo_server.client().completions.create(model=DEFAULT_NAME, prompt="Bob is 30",
                                                    max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_logprobs_zero_gives_the_sampled_tokens_logprob(demo_server):
    import torch

    from tests.tiny import Reference
    prompt = [int(t) for t in np.random.default_rng(3).integers(10, 200, 12)]
    response = post(demo_server, "completions", {
        "prompt": prompt, "logprobs": 0, "temperature": 0, "max_tokens": 8,
        "return_tokens_as_token_ids": True})
    assert response.status_code == 200, response.text[:500]
    logprobs = response.json()["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    assert len(ids) == len(logprobs["token_logprobs"]) == 8
    assert all(not top or len(top) <= 1 for top in logprobs["top_logprobs"] or [])
    logits = torch.tensor(Reference(DEFAULT_MODEL).logits(prompt + ids)[len(prompt) - 1:-1])
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids)), ids].numpy()
    # fp32 log-softmax vs transformers fp32: reduction order differs, 1e-4 on O(1) values
    np.testing.assert_allclose(logprobs["token_logprobs"], want, atol=1e-4, rtol=0)
    # Chat's `logprobs: true` (top_logprobs 0) is the same request.
    response = post(demo_server, "chat/completions", {"logprobs": True, "temperature": 0})
    assert response.status_code == 200, response.text[:500]
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert content and all(entry["top_logprobs"] == [] for entry in content), json.dumps(content)[:500]


def test_a_checkpoint_default_penalty_is_applied_with_and_without_drafts(qwen3, tmp_path):
    """generation_config.json's values are every request's defaults: its repetition
    penalty is applied, as the definition over transformers' logits gives it, beside
    n-gram drafts too (their lookup finds the prompt's repeated ids)."""
    import shutil

    from tests.test_sampler import decisive_greedy
    from tests.tiny import Reference
    from tpu_models.harness.serve_process import Server, launched
    model = shutil.copytree(qwen3, tmp_path / "qwen3")
    (model / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.8}))
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 2,
                        "prompt_lookup_max": 2, "prompt_lookup_min": 2})
    servers = {name: Server(model, "--max-model-len", "64", "--kv-cache-memory-bytes",
                            str(16 << 20), *args, log=tmp_path / f"{name}.log")
               for name, args in [("defaults", ()), ("drafts", ("--speculative-config", ngram))]}
    reference, prompt = Reference(model), [5, 6, 7, 5, 6, 7]
    want = decisive_greedy(reference, prompt, 12, repetition_penalty=1.8)
    assert want != reference.greedy(prompt, 12)
    with launched(servers):
        for name, server in servers.items():
            server.start()
            reply = server.client().completions.create(
                model=str(model), prompt=prompt, max_tokens=12, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            assert reply.choices[0].token_ids == want, name
