"""Tunix's GRPO learner with rollout_engine="vllm" (ours) on a tiny Gemma 3 with LoRA, a
few steps on CPU, then its checkpoint exported and served: the post-training team's
path in one piece. Run as a script by tests/test_tunix_rollouts.py; prints one JSON
line of what it saw.

At every rollout the learner asks for, the vLLM engine and Tunix's own sampler roll
out the same prompts greedily on that step's weights (the trainer's, synced).

    python -m tests.tunix_grpo_run OUT_DIR
"""

import argparse
import json
import os
import re
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
args = parser.parse_args()

import tpu_models.tunix as tpu_tunix  # noqa: E402  (before JAX and vLLM)

import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout, vanilla_rollout  # noqa: E402
from tunix.sft import checkpoint_manager  # noqa: E402

from tpu_models.harness import tunix_models  # noqa: E402

LORA_RANK, LORA_ALPHA, STEPS, TOKENS = 4, 8.0, 3, 8
ANSWER = re.compile(r"^\s*<reasoning>.*?</reasoning>\s*<answer>(.*?)</answer>\s*$", re.S)


seen = []  # (completion, reward) the learner scored


def reward(prompts, completions, answer, **_):
    """Tunix's format, its answer verifiable: 1 for the tags, 1 more for the right answer."""
    scores = []
    for completion, want in zip(completions, answer):
        match = ANSWER.match(completion)
        scores.append(float(bool(match)) + float(bool(match) and match.group(1).strip() == want))
    seen.extend(zip(completions, scores))
    return scores


def main() -> None:
    out = args.out
    cfg = tunix_models.config("tiny")
    tokenizer = tunix_models.model_directory(cfg, out / "model")
    eos = tokenizer.eos_token_id
    mesh = tunix_models.mesh()
    base = tunix_models.build(cfg, mesh=mesh)
    # The run starts from an HF checkpoint: the base, saved as Tunix saves a model, exported.
    checkpoint_manager.CheckpointManager(str(out / "base-ckpt")).save(0, base, force=True)
    actor = tunix_models.with_lora(base, LORA_RANK, LORA_ALPHA)
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=TOKENS, max_prompt_length=32, temperature=0.9, top_p=1.0,
        kv_cache_size=128, eos_tokens=[eos], seed=11, rollout_vllm_model_version=str(out / "model"),
        rollout_vllm_hbm_utilization=0.01, rollout_vllm_init_with_random_weights=True,
        rollout_vllm_tpu_backend_type="jax",
        rollout_mapping_config=tpu_tunix.mapping_config(actor, lora_alpha=LORA_ALPHA))
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=base, tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in (rl_cluster_lib.Role.ACTOR,
                                                   rl_cluster_lib.Role.REFERENCE,
                                                   rl_cluster_lib.Role.ROLLOUT)},
            rollout_engine="vllm", rollout_config=rollout,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adam(3e-2), eval_every_n_steps=100, max_steps=STEPS,
                checkpoint_root_directory=str(out / "ckpt"),
                checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=1,
                                                                   max_to_keep=1))))
    engine = cluster.rollout
    cache = base_rollout.CacheConfig(cache_size=128, num_layers=cfg.num_layers,
                                     num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    greedy = base_rollout.RolloutConfig(**{**rollout.__dict__, "temperature": 0.0, "top_p": None,
                                           "seed": None})
    checks, generate = [], engine.generate

    def checked_generate(prompts, rollout_config, **kwargs):
        """The learner's rollout, and beside it both engines greedy on this step's weights."""
        got = generate(prompts, greedy)
        want = vanilla_rollout.VanillaRollout(cluster.actor_trainer.model, tokenizer, cache) \
            .generate(prompts, greedy)
        checks.append({"vllm": np.asarray(got.tokens).tolist(), "tunix": np.asarray(want.tokens).tolist(),
                       "pad": engine.pad_id()})
        return generate(prompts, rollout_config, **kwargs)

    engine.generate = checked_generate
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=[reward],
        algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.04))
    questions = tunix_models.prompts([5, 9, 12, 7, 6, 10], cfg.num_embed, seed=8)
    data = [{"prompts": np.array(questions[2 * i:2 * i + 2]), "answer": np.array(["t7", "t9"])}
            for i in range(STEPS)]  # batches as Tunix's grain pipelines give them
    learner.train(data)
    final = vanilla_rollout.VanillaRollout(cluster.actor_trainer.model, tokenizer, cache) \
        .generate(questions[:2], greedy)
    report = {"checks": checks, "steps": int(cluster.global_steps), "rewards_seen": seen,
              "final": {"prompts": questions[:2], "tokens": np.asarray(final.tokens).tolist(),
                        "pad": engine.pad_id()},
              "checkpoints": sorted(p.name for p in (out / "ckpt").iterdir())}
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
