"""What each quantization preset costs in quality, and what it saves (model level).

For each preset, the model is built through tpu-inference's own get_model (so
Qwix quantizes it exactly as `vllm serve --additional-config` would) and
compared with the unquantized model on the same sequences:

- top-1 agreement: share of positions whose next-token argmax is the same;
- KL(unquantized || quantized) of the next-token distributions, mean and max
  over positions (nats);
- greedy agreement: each prompt decoded greedily by both models; the share of
  generated tokens before the first divergence, and of prompts identical to
  the end;
- weight bytes: every array of the model state (quantized values + scales);
- decode tokens/s: one decode step (forward + logits) for `--batch`
  sequences, median of `--repeats`, relative to the unquantized model; the
  models take turns step by step, so a drifting host load slows all alike.

`kv:fp8` in `--presets` measures an fp8 KV cache (`--kv-cache-dtype fp8`)
with unquantized weights the same way.

Sequences: for the demo model (default), held-out requests in its chat format
followed by their JSON answers (teacher forcing), the prompts alone for greedy
decoding; `--prompts random` draws token ids instead (any model).

    tpu-models bench quant [MODEL] [--presets int8,fp8,kv:fp8] [--num 32] [--dtype bfloat16]
"""

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np

DEFAULT_PRESETS = ("int8-weight-only", "int8", "fp8", "int4-weight-only", "kv:fp8")


def build(model_dir, quant: str | None = None, **stepper_args):
    """A Stepper over model_dir, quantized with a preset or rules file, or with
    its KV cache stored as `kv:DTYPE` (e.g. kv:fp8); None: unquantized."""
    from tpu_models.harness.stepper import Stepper
    from tpu_models.quant import qwix_rules as rules

    if quant is not None and quant.startswith("kv:"):
        stepper_args["kv_cache_dtype"] = quant[3:]
    elif quant is not None:
        stepper_args["additional_config"] = rules.additional_config(quant)
    return Stepper(model_dir, **stepper_args)


def logits_of(stepper, sequences: list[list[int]]) -> list[np.ndarray]:
    """Next-token logits [len, V] at every position, one prefill per sequence."""
    out = []
    for start in range(0, len(sequences), stepper.max_seqs):
        stepper.reset()
        batch = {f"s{i}": s for i, s in enumerate(sequences[start:start + stepper.max_seqs])}
        got = stepper.step(batch)
        out += [got[name] for name in batch]
    return out


def greedy(stepper, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations, all prompts of a batch decoded together."""
    out = []
    for start in range(0, len(prompts), stepper.max_seqs):
        stepper.reset()
        chunk = {f"p{i}": p for i, p in enumerate(prompts[start:start + stepper.max_seqs])}
        tokens = {n: [] for n in chunk}
        feed = chunk
        for _ in range(max_tokens):
            logits = stepper.step(feed)
            feed = {}
            for name, rows in logits.items():
                tokens[name].append(int(rows[-1].argmax()))
                feed[name] = [tokens[name][-1]]
        out += [tokens[n] for n in chunk]
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare_logits(base: list[np.ndarray], quant: list[np.ndarray], vocab_size: int) -> dict:
    """Top-1 agreement and KL(base || quant) over every position of every sequence."""
    p = np.concatenate([b[:, :vocab_size] for b in base])
    q = np.concatenate([x[:, :vocab_size] for x in quant])
    logp, logq = log_softmax(p), log_softmax(q)
    kl = (np.exp(logp) * (logp - logq)).sum(-1)
    return {"positions": len(p), "top1_agreement": float((p.argmax(-1) == q.argmax(-1)).mean()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}


def compare_greedy(base: list[list[int]], quant: list[list[int]]) -> dict:
    prefix = []
    for a, b in zip(base, quant):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(same / len(a))
    return {"greedy_prefix_agreement": float(np.mean(prefix)),
            "greedy_exact": float(np.mean([a == b for a, b in zip(base, quant)]))}


def weight_bytes(stepper) -> int:
    """Bytes of the model state at each array's bit width.

    int4 counts half a byte: TPUs store it packed, while JAX on CPU reports
    (and may hold) one byte per int4 value.
    """
    import jax.numpy as jnp

    def bits(dtype) -> int:
        kind = jnp.iinfo if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo
        return kind(dtype).bits

    return int(sum(x.size * bits(x.dtype) // 8 for x in stepper.interface.state_leaves))


def decode_step_fn(stepper, batch: int, context: int):
    """A function running one decode step (forward + logits) for `batch`
    sequences of `context` tokens, warmed up."""
    import jax

    stepper.reset()
    stepper.step({f"d{i}": [1 + i] * context for i in range(batch)})
    fns = stepper.interface
    args = stepper.prepare({f"d{i}": [1] for i in range(batch)})

    def decode_step():
        with jax.set_mesh(stepper.mesh):
            stepper.kv_caches, hidden, *_ = fns.model_fn(fns.state_leaves, stepper.kv_caches,
                                                         *args)
            fns.compute_logits_fn(fns.state_leaves, hidden).block_until_ready()

    for _ in range(3):
        decode_step()
    return decode_step


def decode_tokens_per_s(steppers: list, batch: int, context: int, repeats: int) -> list[float]:
    """Decode tokens/s of each stepper. The models take turns step by step, so
    that a host whose load drifts (other processes) slows them all alike."""
    steps = [decode_step_fn(s, batch, context) for s in steppers]
    times = [[] for _ in steps]
    for _ in range(repeats):
        for fn, spent in zip(steps, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [batch / statistics.median(t) for t in times]


def demo_sequences(model_dir, num: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, prompts + reference answers) from the demo's held-out requests."""
    from transformers import AutoTokenizer

    from tpu_models.benchmarks.demo_sets import held_out
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, full = [], []
    for example in held_out(num):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": example["request"]}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        answer = tokenizer.encode(example["answer"] + "<|im_end|>", add_special_tokens=False)
        prompts.append(list(prompt))
        full.append(list(prompt) + answer)
    return prompts, full


def random_sequences(vocab_size: int, num: int, length: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    full = [rng.integers(0, vocab_size, length).tolist() for _ in range(num)]
    return [s[:length // 2] for s in full], full


def evaluate(model_dir, presets, *, prompts: str = "demo", num: int = 32, length: int = 64,
             greedy_tokens: int = 24, batch: int = 8, context: int = 64, repeats: int = 20,
             dtype: str = "float32", speed_only: bool = False) -> list[dict]:
    """One row per preset (the first, `None`, is the unquantized model).

    speed_only: random weights (tpu-inference's dummy loader), weight bytes and
    decode tokens/s only, for shapes no checkpoint here has."""
    stepper_args = dict(dtype=dtype, max_seqs=max(8, batch),
                        pages_per_seq=-(-(context + 8) // 16) if speed_only else 24)
    if speed_only:
        stepper_args["load_format"] = "dummy"
    base = build(model_dir, None, **stepper_args)
    vocab_size = base.vllm_config.model_config.hf_config.vocab_size
    if speed_only:
        prompt_ids = sequences = []
    elif prompts == "demo":
        prompt_ids, sequences = demo_sequences(model_dir, num)
    else:
        prompt_ids, sequences = random_sequences(vocab_size, num, length)

    def quality(stepper) -> tuple[list, list]:
        if speed_only:
            return [np.zeros((1, vocab_size))], [[0]]
        return logits_of(stepper, sequences), greedy(stepper, prompt_ids, greedy_tokens)

    base_logits, base_greedy = quality(base)
    rows = [{"preset": "none", **compare_logits(base_logits, base_logits, vocab_size),
             **compare_greedy(base_greedy, base_greedy), "weight_bytes": weight_bytes(base)}]
    steppers = [base]
    for preset in presets:
        steppers.append(build(model_dir, preset, **stepper_args))
        q_logits, q_greedy = quality(steppers[-1])
        rows.append({"preset": preset, **compare_logits(base_logits, q_logits, vocab_size),
                     **compare_greedy(base_greedy, q_greedy),
                     "weight_bytes": weight_bytes(steppers[-1])})
    for row, speed in zip(rows, decode_tokens_per_s(steppers, batch, context, repeats)):
        row["decode_tok_s"] = speed
    if speed_only:  # random weights: no quality to speak of
        for row in rows:
            for key in ("positions", "top1_agreement", "mean_kl", "max_kl",
                        "greedy_prefix_agreement", "greedy_exact"):
                row.pop(key)
    for row in rows:
        row["weight_ratio"] = row["weight_bytes"] / rows[0]["weight_bytes"]
        row["decode_speed_ratio"] = row["decode_tok_s"] / rows[0]["decode_tok_s"]
    return rows


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for column in ("preset", "top-1 agree", "mean KL", "max KL", "greedy prefix", "greedy exact",
                   "weight MiB", "vs fp", "decode tok/s", "vs fp"):
        table.add_column(column, justify="right")
    for r in rows:
        if "top1_agreement" not in r:
            r = {**r, "top1_agreement": math.nan, "mean_kl": math.nan, "max_kl": math.nan,
                 "greedy_prefix_agreement": math.nan, "greedy_exact": math.nan}
        table.add_row(r["preset"], f"{r['top1_agreement']:.2%}", f"{r['mean_kl']:.2e}",
                      f"{r['max_kl']:.2e}", f"{r['greedy_prefix_agreement']:.1%}",
                      f"{r['greedy_exact']:.1%}", f"{r['weight_bytes'] / 2**20:.2f}",
                      f"{r['weight_ratio']:.2f}x", f"{r['decode_tok_s']:.0f}",
                      f"{r['decode_speed_ratio']:.2f}x")
    Console(width=140).print(table)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="tpu-models bench quant",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded demo)")
    parser.add_argument("--presets", default=",".join(DEFAULT_PRESETS),
                        help="comma-separated presets, rules files, or kv:DTYPE (the KV cache "
                             "stored as DTYPE, weights unquantized)")
    parser.add_argument("--prompts", choices=["demo", "random"], default="demo")
    parser.add_argument("--num", type=int, default=32, help="sequences")
    parser.add_argument("--length", type=int, default=64, help="random sequences' length")
    parser.add_argument("--greedy-tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8, help="decode batch for tokens/s")
    parser.add_argument("--context", type=int, default=64, help="decode context for tokens/s")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--speed-shape", metavar="LAYERS", type=int,
                        help="instead of MODEL: a Qwen3-0.6B-shaped Qwen3-structural with this "
                             "many layers and random weights; weight bytes and decode speed only")
    parser.add_argument("--speed-vocab", type=int, default=151936,
                        help="vocabulary of --speed-shape (Qwen3's by default; smaller keeps "
                             "the tied embedding from dominating the weights)")
    parser.add_argument("--out", default="bench-quant.json")
    args = parser.parse_args(argv)
    from tpu_models.server.serve import DEFAULT_MODEL
    from tpu_models import host
    host.setup_host()  # as `tpu-models serve`: a TPU, else the CPU
    os.environ.setdefault("MODEL_IMPL_TYPE", "flax_nnx")
    model = args.model or str(DEFAULT_MODEL)
    if args.speed_shape:
        import tempfile

        from tpu_models.harness.random_checkpoints import shape_config
        from tpu_models.benchmarks.step import make_model_dir
        model = str(make_model_dir(shape_config("qwen3-0.6b", num_layers=args.speed_shape,
                                                vocab_size=args.speed_vocab),
                                   Path(tempfile.mkdtemp(prefix="bench-quant-"))))
    rows = evaluate(model, [p for p in args.presets.split(",") if p], prompts=args.prompts,
                    num=args.num, length=args.length, greedy_tokens=args.greedy_tokens,
                    batch=args.batch, context=args.context, repeats=args.repeats,
                    dtype=args.dtype, speed_only=bool(args.speed_shape))
    print_table(rows, f"quantization presets vs unquantized ({args.dtype}), {model}")
    document = {"benchmark": "quant_quality", "model": model, "dtype": args.dtype,
                "prompts": args.prompts, "rows": rows}
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps({"benchmark": "quant_quality", "model": model, "dtype": args.dtype,
                      "rows": {r["preset"]: {k: round(v, 6) if isinstance(v, float) else v
                                             for k, v in r.items() if k != "preset"}
                               for r in rows}}))
    return rows


if __name__ == "__main__":
    main()
