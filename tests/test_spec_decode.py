"""Speculative decoding with n-gram prompt lookup is lossless on our models:
the same greedy tokens as without it, 16 requests at once, guided (JSON
schema) and free ones in one batch, while vLLM counts accepted draft tokens.

Guided requests need tpu_models.adapt.structured_output's grammar rows: vLLM sends a bitmask
row per request *and draft position*, tpu-inference 0.32.0 reads one per
request, so later requests were masked by another's grammar (HTTP 500)."""

import asyncio
import json

import numpy as np
import pytest
import requests
import torch

from tpu_models.benchmarks import demo_quality, serving
from tpu_models.benchmarks.demo_sets import held_out
from tpu_models.harness.serve_process import Server, launched
from tpu_models.server.serve import DEFAULT_NAME, SPECULATIVE
from tests.conftest import DEMO_ENGINE
from tests.test_sampler import PENALTIES, decisive_greedy
from tests.test_serve_e2e import complete_all
from tests.tiny import Reference, make_eagle3_draft, make_gemma3

pytestmark = pytest.mark.e2e

NGRAM = json.dumps(SPECULATIVE["ngram"])
CONCURRENT = 16


def accepted_draft_tokens(server) -> float:
    accepted = "vllm:spec_decode_num_accepted_tokens_total"
    return serving.server_counters(server.url, [accepted])[accepted]


def accepted_per_draft(server) -> float:
    """Draft tokens accepted per drafting step (mean acceptance length - 1)."""
    names = ["vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total"]
    counters = serving.server_counters(server.url, names)
    return counters[names[0]] / counters[names[1]]


def chat_answers(server, examples, guided: list[bool]) -> list[str]:
    """Greedy answers to all examples at once; guided[i]: with the JSON schema."""

    async def run():
        client = server.async_client()
        return await asyncio.gather(*[demo_quality.answer(client, DEFAULT_NAME, e, g)
                                      for e, g in zip(examples, guided)])

    return asyncio.run(run())


def test_speculative_demo_gives_the_text_of_plain_decoding(demo_server, tmp_path):
    """`tpu-models serve --speculative ngram|eagle3` (the shipped EAGLE-3 draft:
    the Qwen3-structural target hands it three layers' hidden states), both
    servers started at once. JSON extraction copies the request's words: where
    drafts pay. Every other request is guided, so drafted and guided requests
    share batches. (Upstream's precompilation calls the draft's passes as the
    runner does not, by name: test_compile's EAGLE-3 case runs it.)"""
    examples = held_out(CONCURRENT, novel=True)
    guided = [i % 2 == 1 for i in range(CONCURRENT)]
    plain = chat_answers(demo_server, examples, guided)
    # The n-gram server's steps are programs demo_server precompiled.
    servers = {method: Server(None, *DEMO_ENGINE, "--speculative", method,
                              log=tmp_path / f"{method}.log")
               for method in ("ngram", "eagle3")}
    with launched(servers):
        for method, speculative in servers.items():
            speculative.start()
            got = chat_answers(speculative, examples, guided)
            assert got == plain, method
            assert accepted_draft_tokens(speculative) > 0, method
            # Drafts are verified with the batch's key: a seed would not reproduce; nor
            # are allowed ids or min_tokens applied in verification (the penalties are).
            for name, value in {"seed": 1, "allowed_token_ids": [1, 2],
                                "min_tokens": 2}.items():
                refused = requests.post(f"{speculative.url}/v1/completions", timeout=60, json={
                    "model": DEFAULT_NAME, "prompt": "Bob", "max_tokens": 2, "temperature": 1,
                    name: value})
                assert refused.status_code == 400, (name, refused.text)
                assert refused.json()["error"]["param"] == name, refused.text
        # Every EAGLE-3 draft position must draft well, not just the first (a
        # pass reading another request's row or position would still be
        # lossless); bench spec measures 2.7 of 3 on these requests.
        assert accepted_per_draft(servers["eagle3"]) > 2.0
    for example, text, g in zip(examples, plain, guided):
        if g:
            assert demo_quality.matches_schema(json.loads(text), example["schema"]), text


def test_ngram_on_gemma3_matches_transformers(tmp_path):
    model = make_gemma3(tmp_path / "gemma3", sliding_window=16)
    reference = Reference(model)
    rng = np.random.default_rng(11)
    # Repeated spans give the lookup something to propose.
    prompts = []
    for n in rng.integers(4, 40, CONCURRENT):
        span = rng.integers(0, reference.vocab_size, n).tolist()
        prompts.append(span * 3)
    # logprobs beside drafts, penalized or not: the raw logits' log-softmax (vLLM's
    # default logprobs_mode), the penalties applied to the choice alone.
    penalized = [{}] * 4 + list(PENALTIES.values())
    with Server(model, "--dtype", "float32", "--max-model-len", "512",
                "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "tiny",
                "--speculative-config", NGRAM, log=tmp_path / "serve.log") as s:
        got = complete_all(s, prompts, max_tokens=24)
        accepted = accepted_draft_tokens(s)
        assert accepted > 0
        replies = complete_all(s, prompts[:len(penalized)], 24,
                               [{"logprobs": 1, **p} for p in penalized],
                               read=lambda c: (c.token_ids, c.logprobs.token_logprobs))
        assert accepted_draft_tokens(s) > accepted
    expected = [reference.greedy(prompt, 24) for prompt in prompts]
    for prompt, ids, want in zip(prompts, got, expected):
        assert ids == want, f"prompt of {len(prompt)} tokens"
    for prompt, params, want, (ids, logprobs) in zip(prompts, penalized, expected, replies):
        assert ids == (decisive_greedy(reference, prompt, 24, **params) if params else want), params
        logits = torch.from_numpy(reference.logits(prompt + ids)[len(prompt) - 1:-1])
        exact = torch.log_softmax(logits, -1)[torch.arange(len(ids)), ids].numpy()
        # fp32 log-softmax vs transformers fp32: reduction order differs, 1e-4 on O(1) values
        np.testing.assert_allclose(logprobs, exact, atol=1e-4, rtol=0, err_msg=str(params))


def test_eagle3_draft_on_gemma3_matches_transformers(tmp_path):
    """Gemma 3 hands an EAGLE-3 draft the hidden states of the layers its config
    names, beside its hybrid KV cache (local, global and draft layers share one
    page pool). The draft always proposes the token the target emits most, so
    some drafts are accepted and some rejected; either way the tokens must be
    transformers' greedy ones, and with penalties the definition's over its logits."""
    model = make_gemma3(tmp_path / "target", sliding_window=16)
    reference = Reference(model)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, reference.vocab_size, n).tolist() for n in rng.integers(3, 60, CONCURRENT)]
    expected = [reference.greedy(p, 24) for p in prompts]
    propose = int(np.bincount(np.concatenate(expected)).argmax())
    draft = make_eagle3_draft(model, tmp_path / "draft", aux_layers=(0, 1, 3), propose=propose)
    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
    # Each draft position is verified with the drafts before it counted.
    penalized = [PENALTIES[name] for name in PENALTIES] * 2
    want_penalized = [decisive_greedy(reference, p, 24, **params)
                      for p, params in zip(prompts, penalized)]
    with Server(model, "--dtype", "float32", "--max-model-len", "512",
                "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "tiny",
                "--speculative-config", spec, log=tmp_path / "serve.log") as s:
        got = complete_all(s, prompts, max_tokens=24)
        accepted = accepted_draft_tokens(s)
        assert accepted > 0
        got_penalized = complete_all(s, prompts[:len(penalized)], 24, penalized)
        assert accepted_draft_tokens(s) > accepted
    for prompt, ids, want in zip(prompts, got, expected):
        assert ids == want, f"prompt of {len(prompt)} tokens"
    assert got_penalized == want_penalized


def test_the_eagle3_draft_computes_in_the_served_dtype():
    """tpu-inference 0.32.0 builds its EAGLE-3 draft computing in bfloat16 whatever
    --dtype says: served in float32, the draft's matmuls ran in bfloat16, which
    XLA:CPU runs about 12x slower (adapt.speculative.init_in_the_served_dtype)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh

    from tpu_models.server.serve import DEFAULT_MODEL
    from tpu_models.harness.stepper import load_plugins

    load_plugins()
    from tpu_inference.models.jax.llama_eagle3 import EagleLlama3ForCausalLM
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(DEFAULT_MODEL), dtype="float32", max_model_len=256,
                        speculative_config=SPECULATIVE["eagle3"]).create_engine_config()
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with jax.set_mesh(mesh):
        draft = EagleLlama3ForCausalLM(config, jax.random.PRNGKey(0), mesh)
    computing = {"/".join(map(str, path)): node.dtype for path, node in nnx.iter_graph(draft)
                 if isinstance(node, nnx.Module) and getattr(node, "dtype", None) is not None}
    assert len(computing) >= 5, computing  # the embedding, norms and attention projections
    assert set(computing.values()) == {jnp.dtype(jnp.float32)}, computing


def test_the_eagle3_draft_places_its_logits_in_the_target_vocabulary():
    """EAGLE-3's draft vocabulary maps into the target's by id offsets (target id
    = draft id + d2t[draft id]); every target id without a draft id gets -inf.
    adapt.speculative.compute_logits_gathered does this with a gather instead of
    tpu-inference's scatter: checked against the mapping, in numpy, for a draft
    vocabulary smaller than the target's and offsets that reorder ids."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    from tpu_models.harness.stepper import load_plugins

    load_plugins()
    from tpu_inference.models.jax.llama_eagle3 import EagleLlama3ForCausalLM

    rng = np.random.default_rng(0)
    vocab, draft_vocab, rows, hidden = 40, 12, 5, 8
    targets = np.sort(rng.choice(vocab, draft_vocab, replace=False)).astype(np.int32)
    weight = rng.standard_normal((hidden, draft_vocab)).astype(np.float32)
    states = rng.standard_normal((rows, hidden)).astype(np.float32)
    draft = SimpleNamespace(
        lm_head=lambda h: h @ jnp.asarray(weight),
        draft_id_to_target_id=SimpleNamespace(value=jnp.asarray(targets - np.arange(draft_vocab))),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: vocab)))

    got = np.asarray(EagleLlama3ForCausalLM.compute_logits(draft, jnp.asarray(states)))
    want = np.full((rows, vocab), -np.inf, np.float32)
    want[:, targets] = states @ weight
    # The placement is exact: -inf exactly where a target id has no draft id.
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    # Values: XLA's and numpy's fp32 dots of length K=hidden each err by <= K*u*(|a|@|b|)
    # (u = eps/2; summation order/FMA vary by host), so they differ by <= K*eps*(|a|@|b|),
    # a few 1e-6, far below the O(1) gaps between logits: a misplaced id still fails.
    bound = hidden * np.finfo(np.float32).eps * (np.abs(states).astype(np.float64) @ np.abs(weight))
    np.testing.assert_array_less(np.abs(got[:, targets] - want[:, targets]), bound)


def test_speculative_presets_map_onto_speculative_config(tmp_path):
    from tpu_models.server.serve import EAGLE3_DRAFT, SPECULATIVE, build_command

    for name, config in SPECULATIVE.items():
        command, _ = build_command(["--speculative", name], {})
        assert json.loads(command[command.index("--speculative-config") + 1]) == config
    draft = json.loads((EAGLE3_DRAFT / "config.json").read_text())
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"]
    with pytest.raises(ValueError, match="trained for it"):
        build_command([str(tmp_path), "--speculative", "eagle3"], {})
