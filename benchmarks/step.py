"""Decode-step time against the host's memory-bandwidth limit (model level).

Builds a 0.5B-class Qwen3-structural with random weights through
tpu-inference's own loading path (`--load-format dummy`), then times one
decode step (model forward + logits) at several batch sizes over a context of
`--context` tokens, with the same paged KV cache and attention the server
uses. A decode step must read every weight once and each sequence's KV
cache, so bytes/step over the host's measured read bandwidth is its floor:

    limit = (weight bytes + KV bytes read) / bandwidth,   efficiency = limit / step time

Bandwidth is measured in the same run, right before and right after each
row's steps (this VM's bandwidth drifts by a third between minutes): a
large-array reduction under XLA (read-bound, all cores) and numpy's
single-threaded copy. A row's limit uses the mean of its two samples. The
run also splits the step into attention (context 512 vs 1), sampling, and
logits.

    python -m benchmarks.step [--batch 1,16] [--context 512] [--dtype bfloat16]
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

# A Qwen3-0.6B-shaped decoder (plus the structural head): 0.6B parameters.
CONFIG_0_5B = {
    "architectures": ["Qwen3StructuralForCausalLM"], "model_type": "qwen3",
    "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
}


def timed(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn() (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bandwidth(mib: int = 1024) -> dict:
    """Bytes per second the host reads, as XLA (all threads) and numpy (one) see it,
    over arrays far larger than any cache."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mib * 2**18, ), jnp.float32)
    reduce = jax.jit(lambda a: a.sum())
    xla = x.nbytes / timed(lambda: reduce(x).block_until_ready(), 10)
    a = np.ones(mib * 2**17, np.float32)
    b = np.empty_like(a)
    copy = 2 * a.nbytes / timed(lambda: np.copyto(b, a), 5)  # read + write
    return {"xla_read_gb_s": xla / 1e9, "numpy_copy_gb_s": copy / 1e9}


def make_model_dir(config: dict, directory: Path) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {"<unk>": 0, "a": 1}, unk_token="<unk>")), unk_token="<unk>")
    tok.save_pretrained(directory)
    return directory


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 on TPU, float32 elsewhere (XLA:CPU has no fast bf16 dot)")
    parser.add_argument("--layers", type=int, default=None, help="override (smoke tests)")
    parser.add_argument("--vocab-size", type=int, default=None, help="override (smoke tests)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--bandwidth-mib", type=int, default=1024,
                        help="array size for the bandwidth measurement")
    parser.add_argument("--out", default="bench-step.json")
    args = parser.parse_args(argv)
    from server import portability, serve
    if not serve.has_tpu():  # this host's CPU, never the cloud metadata server
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    portability.install()  # as the engine would: TPU identity, token buckets (off-TPU only)

    import jax
    import jax.numpy as jnp

    from tpu_inference.runner.utils import get_padded_num_reqs_with_upper_limit

    from tpu_models.stepper import Stepper  # the runner-like harness the parity tests use

    if args.dtype is None:
        args.dtype = "bfloat16" if jax.default_backend() == "tpu" else "float32"

    config = dict(CONFIG_0_5B)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    if args.vocab_size:
        config["vocab_size"] = args.vocab_size
    model_dir = make_model_dir(config, Path(tempfile.mkdtemp(prefix="bench-step-")))
    page = 128
    pages_per_seq = -(-(args.context + 8) // page)
    batches = [int(b) for b in args.batch.split(",")]
    stepper = Stepper(model_dir, dtype=args.dtype, page_size=page, pages_per_seq=pages_per_seq,
                      max_seqs=max(batches), load_format="dummy")
    fns = stepper.interface
    weight_bytes = sum(x.nbytes for x in fns.state_leaves)
    # As the runner: the rows that get logits are picked inside a jitted function.
    select = jax.jit(lambda hidden, rows: hidden[rows])
    samples = []  # every bandwidth measurement, in order

    def read_bandwidth() -> float:
        samples.append(bandwidth(args.bandwidth_mib))
        return max(samples[-1]["xla_read_gb_s"], samples[-1]["numpy_copy_gb_s"] / 2)

    rows = []
    for batch in batches:
        for context in (args.context, 1):
            # Fill the cache with `context` tokens per sequence (one prefill step).
            stepper.reset()
            stepper.step({f"r{i}": [1] * context for i in range(batch)})
            decode = {f"r{i}": [1] for i in range(batch)}
            md_step = stepper.prepare(decode)
            # As the runner: logits for each request's last row, padded to its request bucket.
            logit_rows = jnp.minimum(
                jnp.arange(get_padded_num_reqs_with_upper_limit(batch, max(batches))), batch - 1)

            def step():
                stepper.kv_caches, hidden, *_ = fns.model_fn(
                    fns.state_leaves, stepper.kv_caches, *md_step)
                fns.compute_logits_fn(fns.state_leaves,
                                      select(hidden, logit_rows)).block_until_ready()

            bw_before = read_bandwidth()
            seconds = timed(step, args.repeats)
            bw_after = read_bandwidth()
            stepper.kv_caches, hidden, *_ = fns.model_fn(fns.state_leaves, stepper.kv_caches,
                                                         *md_step)
            hidden = select(hidden, logit_rows)
            logits_s = timed(lambda: fns.compute_logits_fn(fns.state_leaves, hidden)
                             .block_until_ready(), args.repeats)
            kv = stepper.kv_caches[0]
            per_token = kv.nbytes / (kv.shape[0] * kv.shape[1])  # one layer, all heads, padded
            kv_bytes = per_token * (context + 1) * batch * len(stepper.kv_caches)
            read_gb_s = (bw_before + bw_after) / 2
            rows.append({"batch": batch, "context": context, "step_ms": seconds * 1e3,
                         "weight_mb": weight_bytes / 2**20, "kv_read_mb": kv_bytes / 2**20,
                         "read_gb_s_before": bw_before, "read_gb_s_after": bw_after,
                         "limit_ms": (weight_bytes + kv_bytes) / (read_gb_s * 1e9) * 1e3,
                         "logits_ms": logits_s * 1e3, "tokens_per_s": batch / seconds})
            rows[-1]["efficiency"] = rows[-1]["limit_ms"] / rows[-1]["step_ms"]

    # Sampling cost at the largest batch (tpu-inference's sampler, greedy and top-p).
    from tpu_inference.layers.jax.sample.sampling import sample  # noqa: F401  (warm import)
    logits = jnp.zeros((max(batches), config["vocab_size"]), jnp.float32)
    argmax = jax.jit(lambda l: jnp.argmax(l, -1))
    greedy_ms = timed(lambda: argmax(logits).block_until_ready(), args.repeats) * 1e3

    result = {"benchmark": "decode_step", "device": str(jax.devices()[0].device_kind),
              "dtype": args.dtype, "layers": config["num_hidden_layers"],
              "params_m": weight_bytes / (2 if args.dtype == "bfloat16" else 4) / 1e6,
              "bandwidth_samples": samples, "greedy_sample_ms": greedy_ms, "rows": rows}
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"decode step, {result['params_m']:.0f}M params {args.dtype}")
    for column in ("batch", "context", "step ms", "of which logits", "read GB/s before/after",
                   "limit ms", "% of limit", "tok/s", "KV MB"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), str(r["context"]), f"{r['step_ms']:.1f}",
                      f"{r['logits_ms']:.1f}",
                      f"{r['read_gb_s_before']:.1f} / {r['read_gb_s_after']:.1f}",
                      f"{r['limit_ms']:.1f}", f"{r['efficiency']:.0%}",
                      f"{r['tokens_per_s']:.1f}", f"{r['kv_read_mb']:.1f}")
    Console(width=120).print(table)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "bandwidth_samples")} |
                     {"efficiency": {f"b{r['batch']}c{r['context']}": r["efficiency"] for r in rows}}))
    return result


if __name__ == "__main__":
    main()
