"""Gemma 3's hybrid KV cache against --disable-hybrid-kv-cache-manager, in one run.

For each mode, one `tpu-models serve` of a Gemma 3 1B-shaped checkpoint
(random weights) at --max-model-len 32768 and a fixed --kv-cache-memory-bytes:
the KV capacity and maximum concurrency vLLM reports, then decode throughput
and TPOT at an 8K-token context (vLLM's metrics, tpu_models.benchmarks.serving).

Shapes: `gemma3-1b` is the released model's (hidden 1152, MLP 6912, vocabulary
262,144); `gemma3-1b-attention` (default) keeps its attention (26 layers, 22
local with window 512, 4 heads, 1 KV head of 256) with a small MLP and
vocabulary, so that on a CPU host the 8K-context decode is the attention's
cost and not the weights' (the KV cache is the same in both).

    python -m tpu_models.benchmarks.hybrid_kv_cache [--shape gemma3-1b] [--out FILE]
"""

import argparse
import json
import tempfile
from pathlib import Path

from tpu_models.harness.random_checkpoints import SHAPES as REAL_SHAPES, random_gemma3

GEMMA3_1B = {k: v for k, v in REAL_SHAPES["gemma3-1b"].items() if k != "arch"}
SHAPES = {
    "gemma3-1b": GEMMA3_1B,
    # its attention (layers, heads, window) with a small residual, MLP and vocabulary
    "gemma3-1b-attention": dict(GEMMA3_1B, hidden_size=256, intermediate_size=512,
                                vocab_size=4096),
}
MODES = {"hybrid": (), "disabled": ("--disable-hybrid-kv-cache-manager",)}


def ideal_ratio(num_layers: int, num_local: int, window: int, max_model_len: int) -> float:
    """KV tokens per request without / with the hybrid cache, from the layer counts alone."""
    num_global = num_layers - num_local
    return num_layers * max_model_len / (num_global * max_model_len + num_local * window)


def measure(model: Path, *, max_model_len: int, batched_tokens: int, kv_bytes: int,
            context: int, output_len: int, concurrencies: list[int], num_prompts: int,
            vocab_size: int, log_dir: Path) -> dict:
    """Per mode: vLLM's KV capacity, then (with concurrencies) the decode sweep."""
    from tpu_models.benchmarks import serving
    from tpu_models.harness.serve_process import Server

    results = {}
    for mode, args in MODES.items():
        server = Server(model, "--dtype", "float32", "--max-model-len", str(max_model_len),
                        "--max-num-batched-tokens", str(batched_tokens),
                        "--kv-cache-memory-bytes", str(kv_bytes), "--served-model-name", "bench",
                        *args, log=log_dir / f"{mode}.log").launch()
        try:
            tokens, concurrency = server.kv_capacity()
            rows = []
            if concurrencies:
                server.start()
                rows = serving.sweep(server.url, "bench", vocab_size=vocab_size,
                                     input_len=context, output_len=output_len,
                                     num_prompts=num_prompts, concurrencies=concurrencies,
                                     warmup=1)
        finally:
            server.stop()
        results[mode] = {"kv_cache_tokens": tokens, "max_concurrency": concurrency,
                         "startup_log": str(log_dir / f"{mode}.log"), "rows": rows}
    return results


def report(results: dict, *, shape: str, max_model_len: int, batched_tokens: int,
           ideal: float) -> dict:
    from rich.console import Console
    from rich.table import Table

    hybrid, disabled = results["hybrid"], results["disabled"]
    table = Table(title=f"{shape}, --max-model-len {max_model_len}, --max-num-batched-tokens "
                        f"{batched_tokens}: hybrid KV cache vs disabled")
    for column in ("", "hybrid", "disabled", "ratio"):
        table.add_column(column, justify="right")
    capacity_ratio = hybrid["max_concurrency"] / disabled["max_concurrency"]
    table.add_row("KV cache (tokens)", f"{hybrid['kv_cache_tokens']:,}",
                  f"{disabled['kv_cache_tokens']:,}",
                  f"{hybrid['kv_cache_tokens'] / disabled['kv_cache_tokens']:.2f}")
    table.add_row(f"max concurrency at {max_model_len}", f"{hybrid['max_concurrency']:.2f}",
                  f"{disabled['max_concurrency']:.2f}", f"{capacity_ratio:.2f} (ideal {ideal:.2f})")
    speed = []
    for h, d in zip(hybrid["rows"], disabled["rows"]):
        c = h["concurrency"]
        ratio = h["output_throughput"] / d["output_throughput"]
        speed.append({"concurrency": c, "throughput_ratio": ratio,
                      "tpot_ratio": h["median_tpot_ms"] / d["median_tpot_ms"]})
        table.add_row(f"output tok/s, concurrency {c}", f"{h['output_throughput']:.1f}",
                      f"{d['output_throughput']:.1f}", f"{ratio:.3f}")
        table.add_row(f"median TPOT ms, concurrency {c}", f"{h['median_tpot_ms']:.1f}",
                      f"{d['median_tpot_ms']:.1f}",
                      f"{h['median_tpot_ms'] / d['median_tpot_ms']:.3f}")
    Console().print(table)
    return {"capacity_ratio": capacity_ratio, "ideal_ratio": ideal, "speed": speed}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="tpu-models bench kv-cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-1b-attention")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help="vLLM reserves each local layer its window plus two steps of these "
                        "(default: `vllm serve`'s on a TPU v6e)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    p.add_argument("--context", type=int, default=8192, help="prompt tokens of the decode runs")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,4", help="'' for the capacity only")
    p.add_argument("--num-prompts", type=int, default=8, help="per concurrency")
    p.add_argument("--out", default="bench-kv-cache.json")
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    work = Path(tempfile.mkdtemp(prefix="tpu-models-kv-cache-"))
    model = random_gemma3(work / args.shape, **shape)
    layer_types = json.loads((model / "config.json").read_text())["layer_types"]
    ideal = ideal_ratio(len(layer_types), layer_types.count("sliding_attention"),
                        shape["sliding_window"], args.max_model_len)
    results = measure(model, max_model_len=args.max_model_len,
                      batched_tokens=args.max_num_batched_tokens,
                      kv_bytes=args.kv_cache_memory_bytes, context=args.context,
                      output_len=args.output_len, num_prompts=args.num_prompts,
                      concurrencies=[int(c) for c in args.concurrency.split(",") if c],
                      vocab_size=shape["vocab_size"], log_dir=work)
    summary = report(results, shape=args.shape, max_model_len=args.max_model_len,
                     batched_tokens=args.max_num_batched_tokens, ideal=ideal)
    document = {"benchmark": "kv-cache", "shape": args.shape, **shape,
                "max_model_len": args.max_model_len,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "kv_cache_memory_bytes": args.kv_cache_memory_bytes, "context": args.context,
                "output_len": args.output_len, **summary, "modes": results}
    Path(args.out).write_text(json.dumps(document, indent=2))
    print(json.dumps({k: document[k] for k in ("benchmark", "capacity_ratio", "ideal_ratio",
                                                "speed")}))


if __name__ == "__main__":
    from tpu_models import host
    host.setup_host()
    main()
