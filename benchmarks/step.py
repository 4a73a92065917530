"""Decode-step time against the host's memory-bandwidth limit (model level).

Builds a model of a real shape (`--shape`: Qwen3-0.6B-shaped Qwen3-structural,
or Gemma 3 1B) with random weights through tpu-inference's own loading path (`--load-format dummy`), then times one
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
logits. With `--lora NxR` the engine runs with N adapter slots of rank R
(--enable-lora), and each row is timed again with the batch's requests spread
round-robin over N random adapters of rank R on every projection: the
per-token cost of adapters chosen per request (tpu_models.lora_slots).

    python -m tpu_models.benchmarks.step [--shape gemma3-1b] [--batch 1,16] [--context 512] [--dtype bfloat16]
                              [--lora 4x16]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from tpu_models.harness.random_checkpoints import SHAPES, shape_config
from tpu_models import adapt, host  # light at import: safe before the host is set up

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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpu-models bench step",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES),
                   help="model shape, random weights")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="default: bfloat16 on TPU, float32 elsewhere (XLA:CPU has no fast bf16 dot)")
    p.add_argument("--layers", type=int, default=None, help="override (smoke tests)")
    p.add_argument("--vocab-size", type=int, default=None, help="override (smoke tests)")
    p.add_argument("--lora", metavar="NxR", default=None,
                   help="also time each step with N adapters of rank R in slots, e.g. 4x16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help="array size for the bandwidth measurement")
    p.add_argument("--out", default="bench-step.json")
    return p


def measure_row(stepper, batch: int, context: int, *, max_seqs: int, repeats: int, select,
                read_bandwidth, adapters=()) -> dict:
    """One decode step of `batch` sequences over `context` cached tokens: its time, the
    host's read bandwidth right before and after, and the limit they set."""
    import jax.numpy as jnp

    from tpu_inference.runner.utils import get_padded_num_reqs_with_upper_limit

    fns = stepper.interface
    weight_bytes = sum(x.nbytes for x in fns.state_leaves)
    # Fill the cache with `context` tokens per sequence (one prefill step).
    stepper.reset()
    stepper.step({f"r{i}": [1] * context for i in range(batch)})
    chunks = {f"r{i}": [1] for i in range(batch)}  # one decode token each
    md_step = stepper.prepare(chunks)
    # As the runner: logits for each request's last row, padded to its request bucket.
    logit_rows = jnp.minimum(
        jnp.arange(get_padded_num_reqs_with_upper_limit(batch, max_seqs)), batch - 1)

    def step():
        stepper.kv_caches, hidden, *_ = fns.model_fn(fns.state_leaves, stepper.kv_caches, *md_step)
        fns.compute_logits_fn(fns.state_leaves, select(hidden, logit_rows)).block_until_ready()

    bw_before = read_bandwidth()
    seconds = timed(step, repeats)
    bw_after = read_bandwidth()
    stepper.kv_caches, hidden, *_ = fns.model_fn(fns.state_leaves, stepper.kv_caches, *md_step)
    hidden = select(hidden, logit_rows)
    logits_s = timed(lambda: fns.compute_logits_fn(fns.state_leaves, hidden).block_until_ready(),
                     repeats)
    kv = stepper.kv_caches[0]
    per_token = kv.nbytes / (kv.shape[0] * kv.shape[1])  # one layer, all heads, padded
    kv_bytes = per_token * (context + 1) * batch * len(stepper.kv_caches)
    read_gb_s = (bw_before + bw_after) / 2
    row = {"batch": batch, "context": context, "step_ms": seconds * 1e3,
           "weight_mb": weight_bytes / 2**20, "kv_read_mb": kv_bytes / 2**20,
           "read_gb_s_before": bw_before, "read_gb_s_after": bw_after,
           "limit_ms": (weight_bytes + kv_bytes) / (read_gb_s * 1e9) * 1e3,
           "logits_ms": logits_s * 1e3, "tokens_per_s": batch / seconds}
    row["efficiency"] = row["limit_ms"] / row["step_ms"]
    if adapters:
        with_lora = stepper.with_adapters(md_step, chunks, {r: adapters[i % len(adapters)]
                                                            for i, r in enumerate(chunks)})

        def lora_step():
            stepper.kv_caches, hidden, *_ = fns.model_fn(fns.state_leaves, stepper.kv_caches,
                                                         *with_lora)
            fns.compute_logits_fn(fns.state_leaves, select(hidden, logit_rows)).block_until_ready()

        row["lora_step_ms"] = timed(lora_step, repeats) * 1e3
        row["lora_vs_off"] = row["step_ms"] / row["lora_step_ms"]
    return row


def measure(args) -> dict:
    """Builds the model and times its decode step at each batch size, over `args.context`
    tokens and over 1; the result document."""
    import jax
    import jax.numpy as jnp

    from tpu_models.harness.stepper import Stepper  # the runner-like harness the parity tests use

    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "tpu" else "float32")
    config = shape_config(args.shape, num_layers=args.layers, vocab_size=args.vocab_size)
    model_dir = make_model_dir(config, Path(tempfile.mkdtemp(prefix="bench-step-")))
    page = 128
    batches = [int(b) for b in args.batch.split(",")]
    lora_args, adapters = {}, []
    if args.lora:
        slots, rank = (int(n) for n in args.lora.split("x"))
        lora_args = dict(enable_lora=True, max_loras=slots, max_lora_rank=rank)
    stepper = Stepper(model_dir, dtype=dtype, page_size=page,
                      pages_per_seq=-(-(args.context + 8) // page), max_seqs=max(batches),
                      load_format="dummy", **lora_args)
    if args.lora:
        from vllm.lora.request import LoRARequest

        from tpu_models.benchmarks.multi_lora import random_adapters
        adapters = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in
                    enumerate(random_adapters(model_dir, model_dir / "adapters", slots, rank))]
    weight_bytes = sum(x.nbytes for x in stepper.interface.state_leaves)
    # As the runner: the rows that get logits are picked inside a jitted function.
    select = jax.jit(lambda hidden, rows: hidden[rows])
    samples = []  # every bandwidth measurement, in order

    def read_bandwidth() -> float:
        samples.append(bandwidth(args.bandwidth_mib))
        return max(samples[-1]["xla_read_gb_s"], samples[-1]["numpy_copy_gb_s"] / 2)

    rows = [measure_row(stepper, batch, context, max_seqs=max(batches), repeats=args.repeats,
                        select=select, read_bandwidth=read_bandwidth, adapters=adapters)
            for batch in batches for context in (args.context, 1)]
    # Greedy sampling's cost at the largest batch: an argmax over the vocabulary.
    logits = jnp.zeros((max(batches), config["vocab_size"]), jnp.float32)
    argmax = jax.jit(lambda l: jnp.argmax(l, -1))
    greedy_ms = timed(lambda: argmax(logits).block_until_ready(), args.repeats) * 1e3
    return {"benchmark": "decode_step", "shape": args.shape,
            "device": str(jax.devices()[0].device_kind),
            "dtype": dtype, "layers": config["num_hidden_layers"], "lora": args.lora,
            "params_m": weight_bytes / (2 if dtype == "bfloat16" else 4) / 1e6,
            "bandwidth_samples": samples, "greedy_sample_ms": greedy_ms, "rows": rows}


def report(result: dict, out: Path) -> None:
    """Prints the table, writes the document to `out`, and prints its summary as the last line."""
    from rich.console import Console
    from rich.table import Table

    rows = result["rows"]
    table = Table(title=f"decode step, {result['shape']}: {result['params_m']:.0f}M params "
                        f"{result['dtype']}")
    lora = result.get("lora")
    columns = ["batch", "context", "step ms", "of which logits", "read GB/s before/after",
               "limit ms", "% of limit", "tok/s", "KV MB"]
    if lora:
        columns += [f"step ms, {lora} LoRA", "off / LoRA"]
    for column in columns:
        table.add_column(column, justify="right")
    for r in rows:
        cells = [str(r["batch"]), str(r["context"]), f"{r['step_ms']:.1f}",
                 f"{r['logits_ms']:.1f}", f"{r['read_gb_s_before']:.1f} / {r['read_gb_s_after']:.1f}",
                 f"{r['limit_ms']:.1f}", f"{r['efficiency']:.0%}",
                 f"{r['tokens_per_s']:.1f}", f"{r['kv_read_mb']:.1f}"]
        if lora:
            cells += [f"{r['lora_step_ms']:.1f}", f"{r['lora_vs_off']:.2f}"]
        table.add_row(*cells)
    Console(width=150).print(table)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "bandwidth_samples")} |
                     {"efficiency": {f"b{r['batch']}c{r['context']}": r["efficiency"] for r in rows}}))


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    host.setup_host()  # this host's CPU unless it has a TPU, never the cloud metadata server
    adapt.apply()  # as the engine would: host portability, token buckets (off-TPU only)
    result = measure(args)
    report(result, Path(args.out))
    return result


if __name__ == "__main__":
    main()
