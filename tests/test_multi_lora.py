"""Many LoRA adapters on one base, chosen per request (--enable-lora), against
transformers fp32 with peft's merge_and_unload of each request's own adapter.

Layers: the model's step with adapters in slots (Stepper, as the engine keeps
them), then the real `vllm serve` (mixed batches, more adapters than slots,
runtime loading, bad adapters)."""

import numpy as np
import pytest
from vllm.lora.request import LoRARequest

from tpu_models.lora import AdapterError
from tpu_models.stepper import Stepper
from tests.tiny import Reference, make_gemma3, make_lora, make_qwen3

# Different ranks, targets and scalings: every projection, rsLoRA, a rank-2 pair.
ADAPTERS = {
    "every": dict(r=4, alpha=16, seed=1),
    "rslora": dict(targets=("q_proj", "v_proj", "down_proj"), r=8, alpha=8, use_rslora=True, seed=2),
    "low": dict(targets=("k_proj", "o_proj", "gate_proj", "up_proj"), r=2, alpha=4, seed=3),
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_qwen3(tmp_path_factory.mktemp("qwen3"), num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_gemma3(tmp_path_factory.mktemp("gemma3"))


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
    # Each adapter must matter: far from the base model.
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
    # Two adapters a step (the engine's --max-loras), cycling through all six
    # and back, so slots and the 3-adapter host cache both evict.
    order = ["a0", "a1", "a2", "a3", "a4", "a5", "a0", "a3"]
    steps, assigned = [], {}
    for k, (x, y) in enumerate(zip(order, order[1:])):
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
