"""Does `tpu-models bench serve` measure what `vllm bench serve` measures?

Starts one server, then on the same workload (random prompts, fixed input and
output lengths, ignore_eos, greedy, one concurrency) runs ours, vLLM's, and ours again
(bracketing vLLM's, so drift shows), and prints each metric's ratio.

    python -m benchmarks.vllm_agreement [--concurrency 4] [--num-prompts 64]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METRICS = [("output_throughput", "output_throughput"), ("request_throughput", "request_throughput"),
           ("median_ttft_ms", "median_ttft_ms"), ("median_tpot_ms", "median_tpot_ms"),
           ("median_itl_ms", "median_itl_ms"), ("median_e2el_ms", "median_e2el_ms")]


def client_env() -> dict:
    """vLLM's CLI imports the platform too: keep tpu-inference off the cloud metadata server."""
    from server.portability import TPU_IDENTITY
    return {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS") or "cpu",
            **TPU_IDENTITY, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", default="bench-vllm-agreement.json")
    args = parser.parse_args(argv)

    from benchmarks import serving
    from benchmarks.compare import DEFAULT_SHAPE, make_pair
    from server.process import Server

    work = Path(tempfile.mkdtemp(prefix="bench-agreement-"))
    model, _ = make_pair(work, DEFAULT_SHAPE)
    common = dict(input_len=args.input_len, output_len=args.output_len,
                  num_prompts=args.num_prompts, concurrencies=[args.concurrency])
    with Server(model, "--served-model-name", "bench", "--max-model-len",
                str(args.input_len + args.output_len + 16), log=work / "serve.log") as server:
        # Client CPU seconds per run: on a small host the client competes with the server.
        cpu = {}
        start = time.process_time()
        ours = [serving.sweep(server.url, "bench", vocab_size=DEFAULT_SHAPE["vocab_size"],
                              avoid_tokens={0, 1}, seed=0, **common)[0]]
        cpu["ours"] = time.process_time() - start
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        result_file = work / "vllm.json"
        subprocess.run([
            sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
            "--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
            "--model", "bench", "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
            # Greedy, as ours: vLLM's bench no longer defaults to temperature 0, and
            # random sampling costs the server more per step than an argmax.
            "--temperature", "0",
            "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-detailed",
            "--save-result", "--result-dir", str(work), "--result-filename", result_file.name],
            check=True, cwd=work, env=client_env())
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu["vllm"] = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
        vllm = json.loads(result_file.read_text())
        ours.append(serving.sweep(server.url, "bench", vocab_size=DEFAULT_SHAPE["vocab_size"],
                                  avoid_tokens={0, 1}, seed=1, **common)[0])
    # The same definitions: our metrics() over vLLM's own per-request timings.
    replayed = serving.metrics([
        serving.Result(ok=not error, prompt_tokens=n_in, output_tokens=n_out, ttft=ttft,
                       latency=latency, itl=list(itl))
        for n_in, n_out, ttft, latency, itl, error in zip(
            vllm["input_lens"], vllm["output_lens"], vllm["ttfts"], vllm["latencies"],
            vllm["itls"], vllm["errors"])], vllm["duration"])
    rows = []
    for ours_key, vllm_key in METRICS:
        before, after, theirs = ours[0][ours_key], ours[1][ours_key], vllm[vllm_key]
        rows.append({"metric": ours_key, "ours_before": before, "vllm": theirs, "ours_after": after,
                     "ratio": (before + after) / 2 / theirs,
                     "same_data_ratio": replayed[ours_key] / theirs})
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"tpu-models bench serve vs vllm bench serve, concurrency "
                        f"{args.concurrency}, {args.input_len} in / {args.output_len} out")
    for column in ("metric", "ours (before)", "vllm bench serve", "ours (after)", "ours / vllm",
                   "ours on vLLM's timings / vllm"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["metric"], f"{r['ours_before']:.2f}", f"{r['vllm']:.2f}",
                      f"{r['ours_after']:.2f}", f"{r['ratio']:.3f}", f"{r['same_data_ratio']:.4f}")
    Console(width=120).print(table)
    print(f"client CPU seconds: ours {cpu['ours']:.1f} (incl. warm-up), vllm bench serve "
          f"{cpu['vllm']:.1f} (incl. its start-up)")
    document = {"benchmark": "vllm_agreement", "concurrency": args.concurrency, "rows": rows,
                "client_cpu_s": cpu}
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps({r["metric"]: round(r["ratio"], 4) for r in rows}))
    return document


if __name__ == "__main__":
    main()
