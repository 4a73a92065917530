"""Tunix's own rollouts, vLLM (ours, in-process) against its vanilla Sampler, on a tiny
Tunix Gemma 3 (tpu_models.harness.tunix_models "tiny"): at load, after the trainer's
weights change, with LoRA. Run as a script by tests/test_tunix_rollouts.py (a process
of its own: fake devices, an in-process engine); prints one JSON line of what it saw.

    python -m tests.tunix_rollouts_run OUT_DIR [--tp 2] [--lora slots|merged]
"""

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--lora", choices=["slots", "merged"])
args = parser.parse_args()
if args.tp > 1:
    from tests.conftest import fake_devices
    os.environ.update(fake_devices(args.tp))

import tpu_models.tunix as tpu_tunix  # noqa: E402  (before JAX and vLLM)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.rl.rollout import base_rollout, vanilla_rollout, vllm_rollout  # noqa: E402

from tpu_models.harness import tunix_models  # noqa: E402

LORA_RANK, LORA_ALPHA = 4, 8.0
STEPS = 8  # tokens per rollout


def refusals(model, cfg, runner) -> list[str]:
    """What a wrong or partial first sync is told (nothing is written before the checks)."""
    from tpu_models.tunix import SyncError
    full = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    extra = next(v for k, v in full.items() if k[-1] == "scale")
    wide = tunix_models.build(dataclasses.replace(cfg, hidden_dim=96))
    cases = {
        "a leaf missing": ({k: v for k, v in full.items()
                            if "/".join(map(str, k)) != "layers/2/mlp/up_proj/kernel"}, model),
        "LoRA parameters alone": (dict(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))), model),
        "a leaf with no engine weight": ({**full, ("layers", 0, "attn", "gate", "scale"): extra}, model),
        "another shape": (dict(nnx.to_flat_state(nnx.state(wide, nnx.Param))), wide)}
    messages = []
    for name, (flat, trainer) in cases.items():
        try:
            tpu_tunix.mapping_config(trainer, lora_alpha=LORA_ALPHA).sync(
                nnx.from_flat_state(flat), runner)
            messages.append(f"{name}: synced")
        except SyncError as e:
            messages.append(f"{name}: {e}")
    return messages


def main() -> None:
    cfg = tunix_models.config("tiny")
    tokenizer = tunix_models.model_directory(cfg, args.out / "model")
    eos = tokenizer.eos_token_id
    mesh = tunix_models.mesh(args.tp)
    model, trained = tunix_models.build(cfg), nnx.Param
    if args.lora:
        model, trained = tunix_models.with_lora(model, LORA_RANK, LORA_ALPHA), nnx.LoRAParam
    # Varied lengths, two sharing a prefix of 24 (prefix caching); all longer than the window but one.
    prompts = tunix_models.prompts((3, 14, 40, 24), cfg.num_embed, seed=3)
    prompts.append(prompts[3] + " " + tunix_models.prompts((9, ), cfg.num_embed, seed=4)[0])
    config = base_rollout.RolloutConfig(
        max_tokens_to_generate=STEPS, max_prompt_length=64, temperature=0.0, top_p=None,
        kv_cache_size=256, eos_tokens=[eos], rollout_vllm_model_version=str(args.out / "model"),
        rollout_vllm_hbm_utilization=0.01, rollout_vllm_init_with_random_weights=True,
        rollout_vllm_tpu_backend_type="jax", tensor_parallel_size=args.tp,
        rollout_mapping_config=tpu_tunix.mapping_config(
            model, lora_alpha=LORA_ALPHA if args.lora else None, lora=args.lora or "slots"))
    cache = base_rollout.CacheConfig(cache_size=256, num_layers=cfg.num_layers,
                                     num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    engine = vllm_rollout.VllmRollout(model, tokenizer, 512, mesh, config)
    report = {"rounds": [], "syncs_s": []}

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
        tunix_models.perturb(model, 10 + step, trained)
        started = time.perf_counter()
        engine.update_params(nnx.state(model, trained), (trained, ))
        jax.block_until_ready(engine._sampler._model_runner.state_leaves)
        report["syncs_s"].append(time.perf_counter() - started)
        compare(f"after sync {step}")

    runner = engine._sampler._model_runner
    report["mesh"] = dict(runner.mesh.shape)
    report["kv_cache_groups"] = len(runner.kv_cache_config.kv_cache_groups)
    report["async_scheduling"] = runner.scheduler_config.async_scheduling
    report["max_logprobs"] = runner.model_config.max_logprobs
    report["refused"] = refusals(model, cfg, runner)
    sampled = base_rollout.RolloutConfig(**{**config.__dict__, "temperature": 1.0, "seed": 5})
    report["seeded"] = [engine.generate([prompts[2]] * 2, sampled).tokens.tolist()
                        for _ in range(2)]
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)  # the in-process engine's threads


if __name__ == "__main__":
    main()
