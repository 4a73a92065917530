"""End to end: the real `vllm serve` (through `tpu-models serve`) against transformers."""

import asyncio

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from tpu_models.harness.serve_process import Server
from tests.tiny import Reference, make_qwen3

pytestmark = pytest.mark.e2e
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen3_structural(tmp_path_factory):
    return make_qwen3(tmp_path_factory.mktemp("qs"), tied=False, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def server(qwen3_structural, tmp_path_factory):
    with Server(qwen3_structural, "--dtype", "float32", "--max-model-len", "8192",
                "--kv-cache-memory-bytes", "268435456", "--served-model-name", "tiny",
                log=tmp_path_factory.mktemp("logs") / "serve.log") as s:
        print(f"startup: {s.startup_seconds:.1f}s")
        yield s


def complete_all(server, prompts, max_tokens=MAX_TOKENS, params=None,
                 read=lambda choice: choice.token_ids):
    """Sends every prompt at once (prompt i with sampling parameters params[i]);
    returns read(choice) per prompt: its generated token ids unless told."""

    async def run():
        client = server.async_client()
        responses = await asyncio.gather(*[
            client.completions.create(
                model="tiny", prompt=p, max_tokens=max_tokens, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
            for p, extra in zip(prompts, params or [{}] * len(prompts))])
        return [read(r.choices[0]) for r in responses]

    return asyncio.run(run())


def test_concurrent_greedy_matches_transformers(server, qwen3_structural):
    reference = Reference(qwen3_structural)
    rng = np.random.default_rng(0)
    vocab = reference.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (1, 2, 7, 16, 33, 64, 150, 300)]
    got = complete_all(server, prompts)
    for prompt, ids in zip(prompts, got):
        assert ids == reference.greedy(prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


def test_long_context_prompt(server, qwen3_structural):
    """6,000 prompt tokens with --max-model-len 8192: completes, first greedy tokens match."""
    reference = Reference(qwen3_structural)
    prompt = np.random.default_rng(1).integers(0, reference.vocab_size, 6000).tolist()
    (ids, ) = complete_all(server, [prompt], max_tokens=4)
    assert ids == reference.greedy(prompt, 4)


def test_streaming_equals_non_streaming(server):
    client = server.client()
    kwargs = dict(model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)]
    # Byte-level tokens that end mid-character are held back and sent with the next one.
    assert len(pieces) >= 6 and "".join(pieces) == whole


def test_chat_uses_template_and_matches_transformers(server, qwen3_structural):
    messages = [{"role": "user", "content": "Who is Alice?"}]
    tokenizer = AutoTokenizer.from_pretrained(qwen3_structural)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    reply = server.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    assert reply.prompt_token_ids == prompt
    assert reply.choices[0].token_ids == Reference(qwen3_structural).greedy(prompt, 6)
    stream = server.client().chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == reply.choices[0].message.content


def test_prompt_over_max_model_len_is_400_and_server_keeps_serving(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt=[5] * 9000, max_tokens=2)
    assert error.value.status_code == 400
    assert "8192" in str(error.value)  # names the limit
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=2).choices[0].text


def test_builtin_qwen3_through_the_same_portability_layer(tmp_path):
    """tpu-inference's own Qwen3ForCausalLM (hard-coded RPA) also runs and matches.

    head_dim 128: the built-in model pads other head sizes to 128 and then
    cannot load their q/k norms.
    """
    checkpoint = make_qwen3(tmp_path / "qwen3", structural=False, num_heads=4, num_kv_heads=1,
                            head_dim=128)
    reference = Reference(checkpoint)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, reference.vocab_size, n).tolist()
               for n in (3, 40, 129)]
    with Server(checkpoint, "--dtype", "float32", "--max-model-len", "512",
                "--kv-cache-memory-bytes", "67108864", "--served-model-name", "tiny",
                log=tmp_path / "serve.log") as s:
        assert "Qwen3ForCausalLM" in s.output()
        got = complete_all(s, prompts)
        # Its sampler is the one adapt.sampling extends: seeds and logit_bias apply here too.
        client = s.client()

        def first_ids(extra=None, **params):
            reply = client.completions.create(
                model="tiny", prompt=prompts[0], max_tokens=6, logprobs=0, **params,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True,
                            **(extra or {})})
            return [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]

        assert first_ids(temperature=1.0, seed=7) == first_ids(temperature=1.0, seed=7)
        logits = reference.logits(prompts[0])[-1]
        biased = first_ids(temperature=0, logit_bias={str(int(np.argmax(logits))): -100})
        assert biased[0] == int(np.argsort(-logits)[1])
        # ... and the penalties and bad words, kept on the device.
        from tests.test_sampler import decisive_greedy
        penalties = {"repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.5}
        want = decisive_greedy(reference, prompts[0], 6, **penalties)
        assert want != reference.greedy(prompts[0], 6)
        assert first_ids(penalties, temperature=0) == want
    for prompt, ids in zip(prompts, got):
        assert ids == reference.greedy(prompt, MAX_TOKENS)
