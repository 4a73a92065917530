"""`tpu-models bench`: its options and dispatch, and the serve benchmark's driver.

`tpu-models` (server/cli.py) reaches `main` through the `tpu_models.commands`
entry point (pyproject.toml), so that server/ imports no benchmark; it has set
up the host (tpu_models.host.setup_host) before. Also runs as
`python -m tpu_models.benchmarks.dispatch ...`.
"""

import argparse
import importlib
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path


# Benchmarks that parse their own options: name -> (module with main(argv), help).
OWN_OPTIONS = {
    "step": ("tpu_models.benchmarks.step", "decode-step time of a real-shaped model (Qwen3-0.6B, Gemma 3 1B) vs the host's "
                                "memory bandwidth (model level)"),
    "kv-cache": ("tpu_models.benchmarks.hybrid_kv_cache", "Gemma 3's hybrid KV cache vs disabled: capacity and "
                                        "8K-context decode (served)"),
    "startup": ("tpu_models.benchmarks.startup", "cold start and warm restart of `tpu-models serve`, by "
                                      "phase"),
    "spec": ("tpu_models.benchmarks.spec_decode", "speculative decoding on the demo model: off, n-gram and "
                                       "EAGLE-3 side by side (tok/s, TPOT, acceptance)"),
    "spec-calls": ("tpu_models.benchmarks.spec_calls", "compiled programs launched per EAGLE-3 "
                   "decode step, fused and not (in-process engines, jax.profiler)"),
    "lora": ("tpu_models.benchmarks.multi_lora", "adapters chosen per request (--enable-lora) vs one "
                                      "merged at load: output tok/s at 1, 4, 16 (served)"),
    "real-scale": ("tpu_models.benchmarks.real_scale", "real-shaped models served one request at a time: "
                                            "TPOT next to the model-level step, start-up, memory"),
    "ab": ("tpu_models.benchmarks.ab", "this tree against another git revision, both served "
                                       "at once, alternated rounds (ratios)"),
    "compile": ("tpu_models.benchmarks.compile_plans", "deployments compiled for their TPUs by "
                "tpu-models compile, and ours vs tpu-inference's Qwen3 program by program "
                "(the TPU compiler's estimates)"),
    "penalties": ("tpu_models.benchmarks.penalties", "the same load with and without presence, "
                  "frequency and repetition penalties: tok/s ratios (served)"),
    "tunix": ("tpu_models.benchmarks.tunix_rollouts", "Tunix's vLLM rollouts on our Gemma 3: "
              "LoRA sync in slots vs merged, rollout tok/s vs Tunix's sampler (in-process)"),
    "multihost": ("tpu_models.benchmarks.multihost", "serving across local hosts (Ray) vs one "
                  "process at the same tensor parallel size: start-up, tok/s, greedy agreement"),
    "quant": ("tpu_models.benchmarks.quant_quality", "quality (top-1, KL, greedy), weight bytes and decode "
                                          "speed of each quantization preset (model level)"),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpu-models bench")
    sub = p.add_subparsers(dest="kind", required=True)
    serve = sub.add_parser("serve", help="throughput and latency of a server, vLLM's metrics")
    target = serve.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="an OpenAI-compatible server already running")
    target.add_argument("--model", help="start `tpu-models serve MODEL` on loopback and measure it")
    target.add_argument("--shape", help="the same, for a random-weight checkpoint of a real shape "
                                        "(qwen3-0.6b, gemma3-1b) written to a temporary directory")
    serve.add_argument("--api-key", default="unused", help="with --base-url, if it needs one")
    serve.add_argument("--server-args", default="", help="extra arguments for the started server")
    serve.add_argument("--tokenizer", help="tokenizer directory (default: --model); sets the "
                                           "vocabulary random prompts are drawn from")
    serve.add_argument("--input-len", type=int, default=128)
    serve.add_argument("--output-len", type=int, default=128)
    serve.add_argument("--num-prompts", type=int, default=32)
    serve.add_argument("--concurrency", type=_ints, default=[1, 4, 16],
                       help="comma-separated sweep, e.g. 1,2,4,8")
    serve.add_argument("--request-rate", type=float, default=math.inf,
                       help="Poisson arrivals per second (default: all at once)")
    serve.add_argument("--warmup", type=int, default=2)
    serve.add_argument("--out", default="bench-serve.json", help="JSON results")
    serve.add_argument("--plot", help="PNG of throughput and TPOT against concurrency")

    compare = sub.add_parser("compare", help="ours vs tpu-inference's built-in Qwen3 vs "
                                             "transformers generate, same weights and workload")
    compare.add_argument("--concurrency", type=_ints, default=[1, 4, 16])
    compare.add_argument("--input-len", type=int, default=128)
    compare.add_argument("--output-len", type=int, default=64)
    compare.add_argument("--num-prompts", type=int,
                         help="per run (default: 8 waves of the concurrency, at least 48)")
    compare.add_argument("--rounds", type=int, default=3,
                         help="runs per server and concurrency, alternated between the servers")
    compare.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    compare.add_argument("--hidden-size", type=int, help="model shape overrides (smoke runs)")
    compare.add_argument("--layers", type=int)
    compare.add_argument("--out", default="bench-compare.json")
    compare.add_argument("--plot", help="PNG of both servers' throughput and TPOT")

    for name, (module, help_text) in OWN_OPTIONS.items():
        sub.add_parser(name, help=help_text).add_argument(
            "args", nargs=argparse.REMAINDER, help=f"see python -m {module} -h")
    return p


def _vocabulary(tokenizer_dir: str) -> tuple[int, set[int]]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return len(tokenizer), set(tokenizer.all_special_ids)


def bench_serve(args) -> dict:
    from tpu_models.benchmarks import serving
    from tpu_models.harness.serve_process import Server

    if args.shape:
        from tpu_models.harness.random_checkpoints import random_checkpoint
        args.model = str(random_checkpoint(
            args.shape, Path(tempfile.mkdtemp(prefix="tpu-models-bench-")) / args.shape))
    tokenizer = args.tokenizer or args.model
    if tokenizer is None:
        sys.exit("tpu-models bench serve: --tokenizer is needed with --base-url")
    vocab_size, special = _vocabulary(tokenizer)
    server = None
    if args.model:
        log = Path(tempfile.mkdtemp(prefix="tpu-models-bench-")) / "serve.log"
        server_args = shlex.split(args.server_args)
        if args.shape and not any(a.startswith("--max-model-len") for a in server_args):
            # Real shapes declare 32K-128K contexts: a KV cache for one such request
            # can exceed the host's budget; the benchmark needs its own lengths only.
            server_args += ["--max-model-len", str(max(512, args.input_len + args.output_len))]
        server = Server(args.model, "--served-model-name", "bench", *server_args, log=log).start()
        base_url, model = server.url, "bench"
        print(f"server up in {server.startup_seconds:.1f}s (log: {log})")
    else:
        base_url = args.base_url.rstrip("/")
        from openai import OpenAI
        model = OpenAI(base_url=f"{base_url}/v1", api_key=args.api_key).models.list().data[0].id
    try:
        rows = serving.sweep(base_url, model, vocab_size=vocab_size, input_len=args.input_len,
                             output_len=args.output_len, num_prompts=args.num_prompts,
                             concurrencies=args.concurrency, request_rate=args.request_rate,
                             warmup=args.warmup, avoid_tokens=special, api_key=args.api_key)
    finally:
        if server:
            server.stop()
    serving.print_table(rows, f"{model}: {args.input_len} in / {args.output_len} out tokens")
    document = {"model": args.model or model, "base_url": base_url, "rows": rows}
    serving.write_json(Path(args.out), document)
    if args.plot:
        serving.plot({args.model or model: rows}, Path(args.plot))
    print(json.dumps({"benchmark": "serve", "rows": [
        {k: r[k] for k in ("concurrency", "output_throughput", "median_ttft_ms",
                           "median_tpot_ms", "failed")} for r in rows]}))
    return document


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in OWN_OPTIONS:
        importlib.import_module(OWN_OPTIONS[argv[0]][0]).main(argv[1:])
        return
    args = parser().parse_args(argv)
    if args.kind == "serve":
        bench_serve(args)
    elif args.kind == "compare":
        from tpu_models.benchmarks.compare import compare
        shape = {k: v for k, v in (("hidden_size", args.hidden_size),
                                   ("num_hidden_layers", args.layers)) if v}
        compare(concurrencies=args.concurrency, input_len=args.input_len,
                output_len=args.output_len, num_prompts=args.num_prompts, shape=shape,
                dtype=args.dtype, rounds=args.rounds, out=args.out, plot=args.plot)


if __name__ == "__main__":
    from tpu_models import host
    host.setup_host()  # as `tpu-models bench`: before anything imports vllm
    main()
