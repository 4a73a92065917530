"""Tunix's own rollouts, vLLM (ours, in-process) against its vanilla Sampler, on a tiny
Tunix Gemma 3: at load, after the trainer's weights change, with LoRA. Run as a
script by tests/test_tunix_rollouts.py (a process of its own: fake devices, an
in-process engine); prints one JSON line of what it saw.

    python -m tests.tunix_rollouts_run OUT_DIR [--tp 2] [--lora slots|merged]
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--lora", choices=["slots", "merged"])
args = parser.parse_args()
if args.tp > 1:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.tp}"

import tpu_models.tunix as tpu_tunix  # noqa: E402  (before JAX and vLLM)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.gemma3 import model as gemma3_lib  # noqa: E402
from tunix.rl.rollout import base_rollout, vanilla_rollout, vllm_rollout  # noqa: E402

from tests.tiny import make_tokenizer  # noqa: E402

# Two KV heads, a window of 8 (prompts are longer), five local layers then a global one.
CONFIG = gemma3_lib.ModelConfig(
    num_layers=6, num_embed=384, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=32,
    num_kv_heads=2, sliding_window_size=8, local_base_frequency=10_000,
    global_base_frequency=1_000_000, param_dtype=jnp.float32)
LORA_RANK, LORA_ALPHA = 4, 8.0
STEPS = 8  # tokens per rollout


def hf_config(config: gemma3_lib.ModelConfig, eos: int) -> dict:
    """The HF config.json vLLM reads for a Tunix Gemma 3 (weights come from the trainer)."""
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "dtype": "float32",
        "vocab_size": config.num_embed, "hidden_size": config.embed_dim,
        "intermediate_size": config.hidden_dim, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "query_pre_attn_scalar": config.head_dim,
        "sliding_window": config.sliding_window_size, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "eos_token_id": eos, "pad_token_id": eos,
        "layer_types": [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
                        for i in range(config.num_layers)],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": float(config.local_base_frequency)},
            "full_attention": {"rope_type": "default", "rope_theta": float(config.global_base_frequency)}}}


def randomize(model, seed: int, kind=nnx.Param, scale: float = 1.0) -> None:
    """Decisive random weights (Tunix zero-initialises MLPs and norms): embeddings small
    beside the blocks' outputs, so that replies are not the last token repeated."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, kind)):
        name, shape = "/".join(map(str, path)), var.get_value().shape
        std = (0.05 if "embedding" in name else 0.2 if name.endswith("scale") else
               0.1 if "_lora_" in name else 1 / np.sqrt(shape[-2] if len(shape) > 1 else 64))
        var.set_value(jnp.asarray(rng.normal(0, std * scale, shape), var.get_value().dtype))


def perturb(model, seed: int, kind) -> None:
    """One 'optimizer step': every weight of `kind` moved by noise."""
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, kind)):
        value = var.get_value()
        var.set_value(value + jnp.asarray(rng.normal(0, 0.05, value.shape), value.dtype))


def refusals(model, runner, trained) -> list[str]:
    """What a wrong or partial first sync is told (nothing is written before the checks)."""
    from tpu_models.tunix import SyncError
    full = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    cases = {"a leaf missing": {k: v for k, v in full.items()
                                if "/".join(map(str, k)) != "layers/2/mlp/up_proj/kernel"},
             "LoRA parameters alone": dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)))}
    extra = next(v for k, v in full.items() if k[-1] == "scale")
    cases["a leaf with no engine weight"] = {**full, ("layers", 0, "attn", "gate", "scale"): extra}
    wide = gemma3_lib.Gemma3(dataclasses.replace(CONFIG, hidden_dim=96), rngs=nnx.Rngs(params=0))
    cases["another shape"] = dict(nnx.to_flat_state(nnx.state(wide, nnx.Param)))
    messages = []
    for name, flat in cases.items():
        mapping = tpu_tunix.mapping_config(wide if name == "another shape" else model,
                                           lora_alpha=LORA_ALPHA)
        try:
            mapping.sync(nnx.from_flat_state(flat), runner)
            messages.append(f"{name}: synced")
        except SyncError as e:
            messages.append(f"{name}: {e}")
    return messages


def main() -> None:
    out = args.out
    model_dir = out / "model"
    tokenizer = make_tokenizer(model_dir, CONFIG.num_embed)
    eos = tokenizer.eos_token_id
    (model_dir / "config.json").write_text(json.dumps(hf_config(CONFIG, eos)))
    devices = np.array(jax.devices()[:args.tp])
    mesh = jax.sharding.Mesh(devices.reshape(1, args.tp), ("fsdp", "tp"),
                             axis_types=(jax.sharding.AxisType.Auto, ) * 2)
    with mesh:
        model = gemma3_lib.Gemma3(CONFIG, rngs=nnx.Rngs(params=0))
    randomize(model, 1)
    trained = nnx.Param
    if args.lora:
        import qwix
        provider = qwix.LoraProvider(
            module_path=".*q_einsum|.*kv_einsum|.*attn_vec_einsum|.*gate_proj|.*up_proj|.*down_proj",
            rank=LORA_RANK, alpha=LORA_ALPHA)
        model = qwix.apply_lora_to_model(model, provider, **model.get_model_input())
        randomize(model, 2, nnx.LoRAParam)
        trained = nnx.LoRAParam

    rng = np.random.default_rng(3)
    shared = tokenizer.decode(rng.integers(3, CONFIG.num_embed, 24).tolist())
    prompts = [tokenizer.decode(rng.integers(3, CONFIG.num_embed, n).tolist()) for n in (3, 14, 40)]
    prompts += [shared, shared + tokenizer.decode(rng.integers(3, CONFIG.num_embed, 9).tolist())]
    config = base_rollout.RolloutConfig(
        max_tokens_to_generate=STEPS, max_prompt_length=64, temperature=0.0, top_p=None,
        kv_cache_size=256, eos_tokens=[eos], rollout_vllm_model_version=str(model_dir),
        rollout_vllm_hbm_utilization=0.01, rollout_vllm_init_with_random_weights=True,
        rollout_vllm_tpu_backend_type="jax", tensor_parallel_size=args.tp,
        rollout_mapping_config=tpu_tunix.mapping_config(
            model, lora_alpha=LORA_ALPHA if args.lora else None, lora=args.lora or "slots"))
    cache = base_rollout.CacheConfig(cache_size=256, num_layers=CONFIG.num_layers,
                                     num_kv_heads=CONFIG.num_kv_heads, head_dim=CONFIG.head_dim)
    started = time.perf_counter()
    engine = vllm_rollout.VllmRollout(model, tokenizer, 512, mesh, config)
    report = {"start_s": time.perf_counter() - started, "rounds": [], "syncs_s": []}

    def compare(label):
        vanilla = vanilla_rollout.VanillaRollout(model, tokenizer, cache)
        want = vanilla._sampler(prompts, max_generation_steps=STEPS, max_prompt_length=64,
                                temperature=0.0, return_logits=True, eos_tokens=[eos])
        got = engine.generate(prompts, config)
        rows = []
        for i in range(len(prompts)):
            ids = [int(t) for t in got.tokens[i] if t != engine.pad_id()][:STEPS]
            ref = [int(t) for t in want.tokens[i]][:STEPS]
            logits = np.asarray(want.logits[i], np.float32)[:len(ref)]
            logp = jax.nn.log_softmax(logits, -1)
            top2 = np.sort(logits, -1)[:, -2:]
            rows.append({"vllm": ids, "tunix": ref,
                         "vllm_logprobs": [float(x) for x in got.logprobs[i]],
                         "tunix_logprobs": [float(logp[j, t]) for j, t in enumerate(ref)],
                         "margins": (top2[:, 1] - top2[:, 0]).tolist()})
        report["rounds"].append({"label": label, "rows": rows})

    compare("load")
    for step in (1, 2):
        perturb(model, 10 + step, trained)
        state = nnx.state(model, trained)
        started = time.perf_counter()
        engine.update_params(state, (trained, ))
        jax.block_until_ready(engine._sampler._model_runner.state_leaves)
        report["syncs_s"].append(time.perf_counter() - started)
        compare(f"after sync {step}")

    runner = engine._sampler._model_runner
    report["mesh"] = dict(runner.mesh.shape)
    report["kv_cache_groups"] = len(runner.kv_cache_config.kv_cache_groups)
    report["refused"] = refusals(model, runner, trained)
    sampled = base_rollout.RolloutConfig(**{**config.__dict__, "temperature": 1.0, "seed": 5})
    twice = [engine.generate([prompts[2]] * 2, sampled).tokens.tolist() for _ in range(2)]
    report["seeded"] = twice
    print("REPORT " + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the in-process engine's threads


if __name__ == "__main__":
    main()
