"""Many LoRA adapters on one base, chosen per request (--enable-lora), against
transformers fp32 with peft's merge_and_unload of each request's own adapter.

Layers: the model's step with adapters in slots (Stepper, as the engine keeps
them), then the real `vllm serve` (mixed batches, more adapters than slots,
runtime loading, bad adapters)."""

import numpy as np
import pytest
from vllm.lora.request import LoRARequest

from tpu_models.lora_slots import AdapterError
from tpu_models.harness.stepper import Stepper
from tests.tiny import Reference, make_lora

# Different ranks, targets and scalings: every projection, rsLoRA, a rank-2 pair.
ADAPTERS = {
    "every": dict(r=4, alpha=16, seed=1),
    "rslora": dict(targets=("q_proj", "v_proj", "down_proj"), r=8, alpha=8, use_rslora=True, seed=2),
    "low": dict(targets=("k_proj", "o_proj", "gate_proj", "up_proj"), r=2, alpha=4, seed=3),
}


def adapters_for(base, directory, specs=ADAPTERS):
    """name -> (LoRARequest, directory)"""
    out = {}
    for i, (name, spec) in enumerate(specs.items(), start=1):
        path = make_lora(base, directory / name, **spec)
        out[name] = (LoRARequest(name, i, str(path)), path)
    return out


def check_steps(stepper, references, steps, assigned, adapters):
    """Runs the steps (request -> tokens); each request's logits must match its
    adapter's reference (assigned: request -> adapter name, None for the base)."""
    seen, worst = {}, 0.0
    for step in steps:
        got = stepper.step(step, {r: adapters[assigned[r]][0] for r in step if assigned[r]})
        for name, tokens in step.items():
            seen[name] = seen.get(name, []) + list(tokens)
            reference = references[assigned[name]]
            want = reference.logits(seen[name])[-len(tokens):]
            have = got[name][:, :reference.vocab_size]
            # fp32 logits vs peft's merge in transformers fp32: reduction order differs,
            # 1e-4 absolute on O(1) logits
            np.testing.assert_allclose(have, want, atol=1e-4, rtol=0,
                                       err_msg=f"request {name} (adapter {assigned[name]})")
            worst = max(worst, float(np.abs(have - want).max()))
    return worst


def mixed_steps(vocab, names, seed=0):
    rng = np.random.default_rng(seed)
    prompts = {n: rng.integers(0, vocab, int(k)).tolist()
               for n, k in zip(names, rng.integers(5, 40, len(names)))}
    first = {n: p[:-3] for n, p in prompts.items()}
    rest = {n: p[-3:] for n, p in prompts.items()}  # a chunked-prefill continuation
    decode = {n: [int(rng.integers(0, vocab))] for n in names}
    return [first, rest, decode, dict(reversed(list(decode.items())))]


@pytest.mark.parametrize("model", ["qwen3", "gemma3"])
def test_mixed_batch_matches_each_adapter_merged_by_peft(model, request, tmp_path):
    base = request.getfixturevalue(model)
    adapters = adapters_for(base, tmp_path)
    references = {None: Reference(base)} | {
        name: Reference(base, adapter=path) for name, (_, path) in adapters.items()}
    stepper = Stepper(base, enable_lora=True, max_loras=3, max_lora_rank=8)
    assigned = {"base": None, "every": "every", "rslora": "rslora", "low": "low",
                "every-again": "every"}
    worst = check_steps(stepper, references, mixed_steps(references[None].vocab_size, assigned),
                        assigned, adapters)
    # Each adapter must matter: far from the base model (500x the 1e-4).
    prompt = list(range(1, 12))
    for name in adapters:
        assert np.abs(references[name].logits(prompt) - references[None].logits(prompt)).max() > 0.05
    print(f"{model}: max |logit diff| vs peft merge_and_unload, mixed batch: {worst:.2e}")


def test_more_adapters_than_slots_stay_exact(qwen3, tmp_path):
    specs = {f"a{i}": dict(r=2 + i % 3, seed=10 + i,
                           targets=("q_proj", "v_proj", "up_proj", "down_proj")) for i in range(6)}
    adapters = adapters_for(qwen3, tmp_path, specs)
    references = {None: Reference(qwen3)} | {
        name: Reference(qwen3, adapter=path) for name, (_, path) in adapters.items()}
    stepper = Stepper(qwen3, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3)
    vocab = references[None].vocab_size
    rng = np.random.default_rng(1)
    # Two adapters a step (the engine's --max-loras) over all six and back, so
    # slots and the 3-adapter host cache both evict; (a0, a3) comes when a0 is
    # the oldest on the host: reading a3 must not evict it.
    pairs = [("a0", "a1"), ("a1", "a2"), ("a0", "a3"), ("a4", "a5"), ("a5", "a0"), ("a3", "a2")]
    steps, assigned = [], {}
    for k, (x, y) in enumerate(pairs):
        rx, ry, rb = f"r{k}-{x}", f"r{k}-{y}", f"r{k}-base"
        assigned |= {rx: x, ry: y, rb: None}
        steps.append({rx: rng.integers(0, vocab, 7).tolist(), rb: rng.integers(0, vocab, 3).tolist(),
                      ry: rng.integers(0, vocab, 5).tolist()})
    worst = check_steps(stepper, references, steps, assigned, adapters)
    print(f"6 adapters over 2 slots: max |logit diff| vs peft: {worst:.2e}")


def test_adapters_the_slots_cannot_take_are_refused_by_name(qwen3, gemma3, tmp_path):
    stepper = Stepper(qwen3, enable_lora=True, max_loras=2, max_lora_rank=8)
    high = make_lora(qwen3, tmp_path / "high", r=16)
    with pytest.raises(AdapterError, match=r"'high'.*rank r=16 is above --max-lora-rank 8"):
        stepper.lora.add_adapter(LoRARequest("high", 1, str(high)))
    other = make_lora(gemma3, tmp_path / "other", r=2)
    with pytest.raises(AdapterError, match=r"'other'.*adapter trained for another model"):
        stepper.lora.add_adapter(LoRARequest("other", 2, str(other)))
    assert stepper.lora.list_adapters() == set()


# --- through `vllm serve` ----------------------------------------------------------

CONCURRENT = 16
MAX_TOKENS = 12


def serve_args(extra=()):
    return ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes",
            str(64 << 20), "--served-model-name", "tiny", "--enable-lora", *extra)


def lora_modules(adapters) -> list[str]:
    return ["--lora-modules", *[f"{name}={path}" for name, (_, path) in adapters.items()]]


def generate_all(server, jobs, prompt_logprobs=False):
    """jobs: [(model name, prompt ids)] sent at once -> [(greedy ids, prompt log-probs)]."""
    import asyncio

    async def run():
        client = server.async_client()
        extra = {"return_token_ids": True, "ignore_eos": True}
        if prompt_logprobs:
            extra["prompt_logprobs"] = 0
        responses = await asyncio.gather(*[
            client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body=extra)
            for model, prompt in jobs])
        out = []
        for r, (_, prompt) in zip(responses, jobs):
            choice = r.choices[0]
            logprobs = None
            if prompt_logprobs:  # [None, {id: {logprob}}, ...]: the prompt's own tokens
                logprobs = [entry[str(t)]["logprob"] for t, entry in
                            zip(prompt[1:], choice.prompt_logprobs[1:])]
            out.append((choice.token_ids, logprobs))
        return out

    return asyncio.run(run())


def reference_logprobs(reference, prompt) -> np.ndarray:
    logits = reference.logits(prompt)[:-1].astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return logp[np.arange(len(prompt) - 1), prompt[1:]]


def check_jobs(server, jobs, references, prompt_logprobs=False):
    got = generate_all(server, jobs, prompt_logprobs)
    for (model, prompt), (ids, logprobs) in zip(jobs, got):
        reference = references[model]
        assert ids == reference.greedy(prompt, MAX_TOKENS), f"{model}: prompt of {len(prompt)}"
        if prompt_logprobs:
            # fp32 log-probs (logits minus their logsumexp) vs transformers fp32: 1e-4, as logits
            np.testing.assert_allclose(logprobs, reference_logprobs(reference, prompt), atol=1e-4,
                                       rtol=0, err_msg=f"{model}: prompt log-probs")


def random_jobs(models, vocab, seed):
    rng = np.random.default_rng(seed)
    return [(models[i % len(models)], rng.integers(0, vocab, int(n)).tolist())
            for i, n in enumerate(rng.integers(2, 60, CONCURRENT))]


@pytest.mark.e2e
def test_served_adapters_share_batches_load_and_unload(qwen3, tmp_path):
    """Qwen3-structural, 3 adapters from --lora-modules beside the base, 16 requests
    at once; then adapters loaded and unloaded at runtime, bad ones refused with
    a 400 that names them while the server keeps serving."""
    import requests as http

    from tpu_models.harness.serve_process import Server

    adapters = adapters_for(qwen3, tmp_path)
    references = {"tiny": Reference(qwen3)} | {
        name: Reference(qwen3, adapter=path) for name, (_, path) in adapters.items()}
    late = make_lora(qwen3, tmp_path / "late", targets=("o_proj", "down_proj"), r=8, seed=7)
    references["late"] = Reference(qwen3, adapter=late)
    too_high = make_lora(qwen3, tmp_path / "too-high", r=16, seed=8)
    dora = make_lora(qwen3, tmp_path / "dora", r=2, seed=9)
    edit_config(dora, use_dora=True)
    vocab = references["tiny"].vocab_size
    with Server(qwen3, *serve_args(["--max-loras", "3", "--max-lora-rank", "8",
                                     *lora_modules(adapters)]),
                env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, log=tmp_path / "serve.log") as s:
        listed = [m.id for m in s.client().models.list().data]
        assert sorted(listed) == sorted(["tiny", *adapters])
        check_jobs(s, random_jobs(["tiny", *adapters], vocab, seed=0), references,
                   prompt_logprobs=True)

        def load(name, path):
            return http.post(f"{s.url}/v1/load_lora_adapter", headers=s.headers(),
                             json={"lora_name": name, "lora_path": str(path)}, timeout=60)

        for name, path, fault in [("too-high", too_high, "rank r=16 is above --max-lora-rank 8"),
                                  ("dora", dora, "use_dora=True is not supported"),
                                  ("missing", tmp_path / "nowhere", "no adapter_config.json")]:
            r = load(name, path)
            assert r.status_code == 400, r.text
            assert f"'{name}'" in r.json()["error"]["message"] and fault in r.json()["error"]["message"]
        unknown = http.post(f"{s.url}/v1/completions", headers=s.headers(), timeout=60,
                            json={"model": "no-such-adapter", "prompt": [1, 2], "max_tokens": 2})
        assert unknown.status_code == 404 and "no-such-adapter" in unknown.text

        assert load("late", late).status_code == 200
        # 4 adapters on 3 slots, and the base, at once.
        check_jobs(s, random_jobs(["late", "tiny", *adapters], vocab, seed=1), references)
        r = http.post(f"{s.url}/v1/unload_lora_adapter", headers=s.headers(), timeout=60,
                      json={"lora_name": "late"})
        assert r.status_code == 200, r.text
        assert "late" not in [m.id for m in s.client().models.list().data]
        gone = http.post(f"{s.url}/v1/completions", headers=s.headers(), timeout=60,
                         json={"model": "late", "prompt": [1, 2], "max_tokens": 2})
        assert gone.status_code == 404


@pytest.mark.e2e
def test_six_adapters_on_two_slots_gemma3_one_from_tunix(tmp_path):
    """Gemma 3 (hybrid sliding-window KV cache), 6 adapters over --max-loras 2 and a
    host cache of 3, 16 requests at once: the scheduler swaps adapters in and out.
    Base and one adapter come from a Tunix LoRA run (`tpu-models export tunix`,
    full and --adapter-only): served, that adapter computes Tunix's own logits.
    Served by plain `MODEL_IMPL_TYPE=flax_nnx vllm serve` (the plugin alone)."""
    from tpu_models.harness.serve_process import PLAIN_VLLM, Server
    from tests.test_export_tunix import FIXTURES, fixture, hf_config_dir, tunix

    meta, tokens = fixture("gemma3")
    base = tunix(FIXTURES / "gemma3" / "full_ckpt", hf_config_dir("gemma3", tmp_path),
                 tmp_path / "base")
    specs = {f"g{i}": dict(r=(2, 4, 8)[i % 3], seed=20 + i, use_rslora=i == 3,
                           targets=(("q_proj", "k_proj", "v_proj", "o_proj"),
                                    ("gate_proj", "up_proj", "down_proj"))[i % 2])
             for i in range(5)}
    adapters = adapters_for(base, tmp_path, specs)
    exported = tunix(FIXTURES / "gemma3" / "lora_ckpt", base, tmp_path / "tunix",
                     lora_alpha=meta["lora"]["alpha"], adapter_only=True)
    adapters["tunix"] = (None, exported)
    references = {"tiny": Reference(base)} | {
        name: Reference(base, adapter=path) for name, (_, path) in adapters.items()}
    with Server(base, *serve_args(["--max-loras", "2", "--max-cpu-loras", "3",
                                    "--max-lora-rank", "8", "--host", "127.0.0.1",
                                    *lora_modules(adapters)]),
                command=PLAIN_VLLM, env={"MODEL_IMPL_TYPE": "flax_nnx"}, log=tmp_path / "serve.log") as s:
        check_jobs(s, random_jobs(["tiny", *adapters], references["tiny"].vocab_size, seed=2),
                   references)
        ((_, served), ) = generate_all(s, [("tunix", tokens)], prompt_logprobs=True)
    tunix_logits = np.load(FIXTURES / "gemma3" / "lora_logits.npy")[0].astype(np.float64)
    tunix_logits -= tunix_logits.max(-1, keepdims=True)
    tunix_logp = tunix_logits - np.log(np.exp(tunix_logits).sum(-1, keepdims=True))
    want = tunix_logp[np.arange(len(tokens) - 1), tokens[1:]]
    # fp32 log-probs, served vs Tunix's XLA forward (fixture): reduction order differs, 1e-4
    np.testing.assert_allclose(served, want, atol=1e-4, rtol=0)


@pytest.mark.e2e
def test_a_bad_lora_modules_entry_stops_start_up_naming_it(qwen3, tmp_path):
    from tpu_models.harness.serve_process import Server

    bad = make_lora(qwen3, tmp_path / "biased", r=2)
    edit_config(bad, bias="lora_only")
    server = Server(qwen3, *serve_args(["--max-lora-rank", "8", "--lora-modules", f"biased={bad}"]),
                    log=tmp_path / "serve.log")
    assert server.wait_exit() != 0
    assert "LoRA adapter 'biased'" in server.output() and "bias='lora_only'" in server.output()


def test_merging_and_per_request_adapters_are_not_mixed(tmp_path):
    from tpu_models.server.serve import build_command

    with pytest.raises(ValueError, match="--lora .* or --enable-lora"):
        build_command(["--lora", str(tmp_path), "--enable-lora"], {})


def edit_config(adapter, **fields):
    import json
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


@pytest.mark.slow  # a process of its own, three tensor-parallel sizes
def test_adapters_shard_like_their_base_weights(tmp_path):
    """TP 1, 2 and 4 (fake CPU devices): each request's logits equal peft's merge of
    its adapter, and each slot buffer is split along its base kernel's split axes."""
    import json

    from tests.test_tensor_parallel import MODELS, run_worker

    base = MODELS["qwen3-structural"](tmp_path / "base")  # one KV head: replicated K/V over 2, 4
    adapters = [make_lora(base, tmp_path / f"a{i}", r=r, seed=30 + i, use_rslora=i == 1)
                for i, r in enumerate((4, 8, 2))]
    out = tmp_path / "tp.json"
    run_worker([str(base), str(out), *map(str, adapters)], tmp_path / "tp.log")
    results = json.loads(out.read_text())
    references = {f"r{i}": Reference(base, adapter=a) for i, a in enumerate(adapters)}
    references["base"] = Reference(base)
    for tp in ("1", "2", "4"):
        for name, logits in results[tp]["logits"].items():
            want = references[name].logits(results["prompts"][name])[-1]
            # fp32 logits vs peft in transformers fp32 (sharded sums included): 1e-4 on O(1)
            np.testing.assert_allclose(logits[:383], want, atol=1e-4, rtol=0, err_msg=f"TP={tp} {name}")
    specs, base_specs = results["4"]["shardings"], results["4"]["base_shardings"]
    # A [*in, S, R] takes the kernel's input axes, B [S, R, *out] its output axes.
    m = "model"
    assert base_specs["q_proj"] == [None, m, None] and base_specs["o_proj"] == [m, None, None]
    assert specs["a:q_proj"] == [None, None, None] and specs["b:q_proj"] == [None, None, m, None]
    assert specs["a:o_proj"] == [m, None, None, None] and specs["b:o_proj"] == [None, None, None]
    assert specs["b:up_proj"] == [None, None, m] and specs["a:down_proj"] == [m, None, None]
    # one KV head over 4 devices: K/V replicated, their adapters too
    assert base_specs["k_proj"] == [None, None, None] and specs["b:k_proj"] == [None, None, None, None]


def test_adapters_on_a_qwix_quantized_base(qwen3, tmp_path):
    """int8 weight-only base (a Qwix preset) with an adapter in a slot: off peft's
    merged fp32 model by the quantization error alone, far less than the adapter moves it."""
    from tpu_models.benchmarks.quant_quality import build

    adapter = make_lora(qwen3, tmp_path / "adapter", r=8, seed=5)
    request = LoRARequest("q", 1, str(adapter))
    rng = np.random.default_rng(3)
    sequences = [rng.integers(0, 384, 24).tolist() for _ in range(4)]

    def log_probs(logits):
        x = np.asarray(logits, np.float64)[..., :384]
        x -= x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    stepper = build(qwen3, "int8-weight-only", enable_lora=True, max_lora_rank=8)
    batch = {f"s{i}": s for i, s in enumerate(sequences)}
    with_adapter = log_probs(np.concatenate(list(stepper.step(batch, dict.fromkeys(batch, request))
                                                 .values())))
    stepper.reset()
    quantized_base = log_probs(np.concatenate(list(stepper.step(batch).values())))
    merged = log_probs(np.concatenate([Reference(qwen3, adapter=adapter).logits(s) for s in sequences]))
    base = log_probs(np.concatenate([Reference(qwen3).logits(s) for s in sequences]))
    quantization_error = np.abs(quantized_base - base).mean()
    error = np.abs(with_adapter - merged).mean()
    effect = np.abs(merged - base).mean()
    print(f"int8 base + adapter: mean |dlogp| vs peft {error:.2e}; quantization alone "
          f"{quantization_error:.2e}; the adapter's effect {effect:.2e}")
    # int8 weight-only: 0.68% relative per matmul (test_quant.py), far above fp32's ~1e-6
    assert quantization_error > 1e-6  # the base is quantized
    # the same int8 weights under the adapter's slightly moved activations: an error of the
    # same size (2x), not the adapter's effect
    assert error < 2 * quantization_error
    assert effect > 20 * error
