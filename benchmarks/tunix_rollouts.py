"""Tunix rollouts on our engine (tpu_models.tunix): sync times and rollout tokens/s.

A Tunix Gemma 3 trainer with qwix LoRA (random weights, float32), rolled out by
Tunix's own VllmRollout (vLLM in-process, our Gemma 3) and by its VanillaRollout
sampler, one engine per LoRA mode, each in a process of its own:
  sync      one update_params of the LoRA parameters alone (what Tunix's RLCluster
            sends after a LoRA step), median of --syncs: into our LoRA slots, or
            merged into every targeted weight; and one full-weight sync (at load).
  rollouts  --prompts prompts of varied length, greedy, --tokens tokens each: the
            same batch through both engines, alternated for --rounds after a
            warm-up round; generated tokens/s and the median of the rounds' ratios.
  groups    with --group G, GRPO's workload instead: --prompts / G prompts sharing
            a template (--template words, then 8-64 of their own), each repeated G
            times in a row as GRPO repeats them (num_generations), sampled at
            --temperature with a seed (lengths differ within a group where EOS is
            drawn); completions/s and tokens/s, ours over Tunix's sampler.

    tpu-models bench tunix [--shape tiny,gemma3-1b] [--prompts 64] [--tokens 32]
        [--group 8 --temperature 0.9 --template 30]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("slots", "merged")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpu-models bench tunix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny,gemma3-1b",
                   help="tpu_models.harness.tunix_models shapes, comma-separated")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--words", default="8,64", help="prompt lengths drawn from MIN,MAX words")
    p.add_argument("--tokens", type=int, default=32, help="tokens per rollout")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--rollouts-in", default="slots,merged",
                   help="LoRA modes whose engine also runs the rollouts (sync times: both)")
    p.add_argument("--group", type=int, default=1,
                   help="completions per prompt (GRPO's num_generations); 1: greedy rollouts")
    p.add_argument("--temperature", type=float, default=0.9, help="with --group")
    p.add_argument("--template", type=int, default=30,
                   help="with --group: words every prompt starts with")
    p.add_argument("--out", default="bench-tunix.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # SHAPE:MODE, in a process of its own
    return p


def worker(args) -> dict:
    """One engine (one shape, one LoRA mode), in this process."""
    shape, mode = args.worker.split(":")
    import tpu_models.tunix as tpu_tunix  # before JAX and vLLM

    import jax
    import numpy as np
    from flax import nnx
    from tunix.rl.rollout import base_rollout, vanilla_rollout, vllm_rollout

    from tpu_models.harness import tunix_models
    cfg = tunix_models.config(shape)
    work = Path(tempfile.mkdtemp(prefix="bench-tunix-"))
    tokenizer = tunix_models.model_directory(cfg, work / "model")
    model = tunix_models.with_lora(tunix_models.build(cfg), args.lora_rank, 2.0 * args.lora_rank)
    prompts, prompt_len = workload(args, cfg.num_embed)
    grouped = args.group > 1
    config = base_rollout.RolloutConfig(
        max_tokens_to_generate=args.tokens, max_prompt_length=prompt_len,
        temperature=args.temperature if grouped else 0.0, seed=7 if grouped else None,
        top_p=None, rollout_vllm_model_version=str(work / "model"),
        rollout_vllm_hbm_utilization=0.05, rollout_vllm_init_with_random_weights=True,
        rollout_vllm_tpu_backend_type="jax",
        rollout_mapping_config=tpu_tunix.mapping_config(model, lora_alpha=2.0 * args.lora_rank,
                                                        lora=mode))
    mesh = tunix_models.mesh()
    vllm = vllm_rollout.VllmRollout(model, tokenizer, prompt_len + args.tokens + 8, mesh, config)
    runner = vllm._sampler._model_runner

    def timed_sync(state, kinds) -> float:
        started = time.perf_counter()
        vllm.update_params(state, kinds)
        jax.block_until_ready((runner.state_leaves, getattr(runner.lora_manager, "a", None)))
        return time.perf_counter() - started

    result = {"shape": shape, "mode": mode, "lora_rank": args.lora_rank,
              "full_sync_s": timed_sync(nnx.state(model), None), "lora_sync_s": []}
    for i in range(args.syncs):
        tunix_models.perturb(model, 100 + i, nnx.LoRAParam)
        result["lora_sync_s"].append(timed_sync(nnx.state(model, nnx.LoRAParam), (nnx.LoRAParam, )))
    if mode not in args.rollouts_in.split(","):
        return result
    vanilla = vanilla_rollout.VanillaRollout(model, tokenizer, base_rollout.CacheConfig(
        cache_size=prompt_len + args.tokens + 8, num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
    engines = {"vllm": vllm, "vanilla": vanilla}

    def tokens_per_s(name) -> float:
        started = time.perf_counter()
        out = engines[name].generate(prompts, config)
        seconds = time.perf_counter() - started
        completions[name].append(len(out.tokens) / seconds)
        return sum(int((np.asarray(row) != engines[name].pad_id()).sum())
                   for row in out.tokens) / seconds

    completions = {name: [] for name in engines}

    for name in engines:  # warm-up: compiles
        tokens_per_s(name)
    runs = {name: [] for name in engines}
    for name in engines:
        completions[name].clear()  # the warm-up's left out
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            runs[name].append(tokens_per_s(name))
    result["rollouts"] = {
        "prompts": args.prompts, "words": args.words, "tokens": args.tokens, "runs": runs,
        "group": args.group, "temperature": config.temperature,
        "template_words": args.template if grouped else 0,
        "completions_runs": completions,
        "completions_per_s": {n: statistics.median(c) for n, c in completions.items()},
        "completions_ratio": statistics.median(
            a / b for a, b in zip(completions["vllm"], completions["vanilla"])),
        "vllm_tok_s": statistics.median(runs["vllm"]),
        "vanilla_tok_s": statistics.median(runs["vanilla"]),
        "ratio": statistics.median(a / b for a, b in zip(runs["vllm"], runs["vanilla"]))}
    return result


def workload(args, vocab: int) -> tuple[list[str], int]:
    """(the rollout's prompts, Tunix's max prompt length): varied greedy prompts, or
    with --group GRPO's groups: distinct prompts on a shared template, each G times."""
    import numpy as np

    from tpu_models.harness import tunix_models
    low, high = (int(x) for x in args.words.split(","))
    if args.group <= 1:
        lengths = np.random.default_rng(0).integers(low, high + 1, args.prompts)
        return tunix_models.prompts(lengths, vocab, seed=1), 1 << int(high - 1).bit_length()
    distinct = max(1, args.prompts // args.group)
    template = tunix_models.prompts([args.template], vocab, seed=2)[0]
    tails = tunix_models.prompts(np.random.default_rng(0).integers(low, high + 1, distinct),
                                 vocab, seed=1)
    prompts = [f"{template} {tail}" for tail in tails for _ in range(args.group)]
    return prompts, 1 << int(args.template + high - 1).bit_length()


def measure(args) -> dict:
    rows = []
    for shape in args.shape.split(","):
        for mode in MODES:
            run = subprocess.run([sys.executable, "-m", "tpu_models.benchmarks.tunix_rollouts",
                                  *(sys.argv[1:] if args.argv is None else args.argv),
                                  "--worker", f"{shape}:{mode}"],
                                 capture_output=True, text=True,
                                 env={**os.environ, "SKIP_JAX_PRECOMPILE": "1"})
            line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if run.returncode or line is None:
                print(f"bench tunix {shape} {mode} failed (exit {run.returncode}):\n"
                      f"{run.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(line.removeprefix("RESULT ")))
    for shape in args.shape.split(","):
        of = {r["mode"]: statistics.median(r["lora_sync_s"]) for r in rows if r["shape"] == shape}
        for r in rows:
            if r["shape"] == shape and len(of) == 2:
                r["merged_over_slots"] = of["merged"] / of["slots"]
    return {"benchmark": "tunix rollouts", "rows": rows, "lora_rank": args.lora_rank,
            "note": "random weights, float32, this host's CPU; one engine per mode"}


def report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"Tunix rollouts on tpu-models (LoRA rank {result['lora_rank']}): "
                        "syncs (medians) and rollouts, vLLM vs Tunix's vanilla sampler")
    for column in ("shape", "LoRA", "full sync ms", "LoRA sync ms", "vLLM tok/s",
                   "vanilla tok/s", "x vanilla", "completions/s vLLM / vanilla"):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        roll = r.get("rollouts")
        per_s = roll and roll.get("completions_per_s")
        table.add_row(r["shape"], r["mode"], f"{1e3 * r['full_sync_s']:.1f}",
                      f"{1e3 * statistics.median(r['lora_sync_s']):.1f}",
                      f"{roll['vllm_tok_s']:.1f}" if roll else "-",
                      f"{roll['vanilla_tok_s']:.1f}" if roll else "-",
                      f"{roll['ratio']:.2f}" if roll else "-",
                      f"{per_s['vllm']:.1f} / {per_s['vanilla']:.1f}" if per_s else "-")
    Console().print(table)


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        os._exit(0)  # the in-process engine's threads
    args.argv = argv
    from tpu_models.benchmarks import serving
    result = measure(args)
    report(result)
    serving.write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
