"""Does `tpu-models bench serve` measure what `vllm bench serve` measures?

Starts one server, then on the same workload (random prompts, fixed input and
output lengths, ignore_eos, greedy, one concurrency) alternates ours and vLLM's
(ours first and last, so drift hits both alike), and prints the ratio of each
metric's medians over the runs. Each run also records the server's own mean
TTFT (its `/metrics` histogram before and after), which tells a gap in the
server's work from one in a client's clock.

    python -m tpu_models.benchmarks.vllm_agreement [--concurrency 4] [--repeats 2] [--num-prompts N]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tpu_models.benchmarks import serving
from tpu_models import host

# Keys of both tools' JSON (vLLM's names); server_mean_ttft_ms is added per run here.
METRICS = ["output_throughput", "request_throughput", "median_ttft_ms", "mean_ttft_ms",
           "server_mean_ttft_ms", "median_tpot_ms", "median_itl_ms", "median_e2el_ms"]


def client_env() -> dict:
    """`vllm bench serve`'s environment: vLLM's CLI imports the platform too, so its JAX
    runs on the CPU (a client needs no accelerator) and tpu-inference gets a TPU identity
    instead of asking the cloud metadata server."""
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    host.setup_host("cpu", env)
    return env


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=None,
                   help="per run (default: 8 waves of --concurrency, at least 48)")
    p.add_argument("--repeats", type=int, default=2,
                   help="vLLM runs, each between two of ours (ours runs repeats + 1 times)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default="bench-vllm-agreement.json")
    return p


def measure(args) -> dict:
    """Serves one model and alternates our runs and `vllm bench serve`'s on it: each side's
    runs (its metrics, plus the server's view), and their client CPU seconds."""
    from tpu_models.benchmarks.compare import DEFAULT_SHAPE, make_pair
    from tpu_models.harness.serve_process import Server

    num_prompts = args.num_prompts or serving.default_num_prompts(args.concurrency)
    work = Path(tempfile.mkdtemp(prefix="bench-agreement-"))
    model, _ = make_pair(work, DEFAULT_SHAPE)
    result_file = work / "vllm.json"
    vllm_command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "openai", "--endpoint", "/v1/completions",
        "--model", "bench", "--tokenizer", str(model), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(args.concurrency),
        # Greedy, as ours: vLLM's bench no longer defaults to temperature 0, and
        # random sampling costs the server more per step than an argmax.
        "--temperature", "0",
        "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-detailed",
        "--save-result", "--result-dir", str(work), "--result-filename", result_file.name]
    ours, theirs = [], []
    cpu = {"ours": 0.0, "vllm": 0.0}  # client CPU seconds: the client shares the host's cores

    def server_side(run: dict, before: dict[str, float]) -> None:
        """Adds the server's own view of the run, its warm-up requests included."""
        delta = {k: v - before[k] for k, v in serving.server_counters(server.url).items()}
        run["server_mean_ttft_ms"] = (delta["vllm:time_to_first_token_seconds_sum"] * 1000
                                      / delta["vllm:time_to_first_token_seconds_count"])
        run["server_cached_prompt_tokens"] = delta["vllm:prompt_tokens_cached_total"]

    def run_ours(seed):
        start, before = time.process_time(), serving.server_counters(server.url)
        ours.append(serving.sweep(server.url, "bench", vocab_size=DEFAULT_SHAPE["vocab_size"],
                                  avoid_tokens={0, 1}, seed=seed, input_len=args.input_len,
                                  output_len=args.output_len, num_prompts=num_prompts,
                                  concurrencies=[args.concurrency])[0])
        cpu["ours"] += time.process_time() - start
        server_side(ours[-1], before)

    # No prefix caching: on a small tokenizer vLLM's random prompts repeat (36 of
    # 128 were one run of special tokens), and cached prefills would make its
    # workload lighter than ours.
    with Server(model, "--served-model-name", "bench", "--no-enable-prefix-caching",
                "--max-model-len", str(args.input_len + args.output_len + 16),
                log=work / "serve.log") as server:
        # Alternate, so that drift of a small shared host hits both sides alike.
        for seed in range(args.repeats):
            run_ours(seed)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            counters = serving.server_counters(server.url)
            subprocess.run(vllm_command + ["--base-url", server.url, "--seed", str(seed)],
                           check=True, cwd=work, env=client_env())
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu["vllm"] += (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            theirs.append(json.loads(result_file.read_text()))
            server_side(theirs[-1], counters)
        run_ours(args.repeats)
    return {"num_prompts": num_prompts, "ours": ours, "vllm": theirs, "client_cpu_s": cpu}


def agreement(args, runs: dict) -> dict:
    """The result document: per metric, both sides' runs and the ratio of their medians,
    and our metrics() replayed over vLLM's own per-request timings of its last run."""
    ours, theirs = runs["ours"], runs["vllm"]
    # The same definitions: our metrics() over vLLM's own per-request timings.
    vllm = theirs[-1]
    replayed = serving.metrics([
        serving.Result(ok=not error, prompt_tokens=n_in, output_tokens=n_out, ttft=ttft,
                       latency=latency, itl=list(itl))
        for n_in, n_out, ttft, latency, itl, error in zip(
            vllm["input_lens"], vllm["output_lens"], vllm["ttfts"], vllm["latencies"],
            vllm["itls"], vllm["errors"])], vllm["duration"])
    rows = []
    for key in METRICS:
        mine = [run[key] for run in ours]
        other = [run[key] for run in theirs]
        rows.append({"metric": key, "ours": mine, "vllm": other,
                     "ratio": statistics.median(mine) / statistics.median(other),
                     # None for the server's own figure, which no client replays
                     "same_data_ratio": replayed[key] / vllm[key] if key in replayed else None})
    cached = {side: sum(run["server_cached_prompt_tokens"] for run in runs[side])
              for side in ("ours", "vllm")}
    return {"benchmark": "vllm_agreement", "concurrency": args.concurrency,
            "num_prompts": runs["num_prompts"], "input_len": args.input_len,
            "output_len": args.output_len, "rows": rows, "client_cpu_s": runs["client_cpu_s"],
            "cached_prompt_tokens": cached}


def report(document: dict, out: Path) -> None:
    """Prints the table and the cache and CPU lines, writes the document to `out`, and
    prints each metric's ratio as the last line."""
    from rich.console import Console
    from rich.table import Table

    rows, cpu, cached = document["rows"], document["client_cpu_s"], document["cached_prompt_tokens"]
    table = Table(title=f"tpu-models bench serve vs vllm bench serve, concurrency "
                        f"{document['concurrency']}, {document['num_prompts']} x "
                        f"{document['input_len']} in / {document['output_len']} out, medians of "
                        f"{len(rows[0]['ours'])} and {len(rows[0]['vllm'])} runs")
    for column in ("metric", "ours (runs)", "vllm bench serve (runs)", "ours / vllm",
                   "ours on vLLM's timings / vllm"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["metric"], " ".join(f"{v:.1f}" for v in r["ours"]),
                      " ".join(f"{v:.1f}" for v in r["vllm"]), f"{r['ratio']:.3f}",
                      "-" if r["same_data_ratio"] is None else f"{r['same_data_ratio']:.4f}")
    Console(width=140).print(table)
    print(f"prompt tokens served from the prefix cache: ours {cached['ours']:.0f}, "
          f"vllm bench serve {cached['vllm']:.0f}")
    print(f"client CPU seconds: ours {cpu['ours']:.1f} (incl. warm-up), vllm bench serve "
          f"{cpu['vllm']:.1f} (incl. its start-up)")
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps({r["metric"]: round(r["ratio"], 4) for r in rows}))


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    document = agreement(args, measure(args))
    report(document, Path(args.out))
    return document


if __name__ == "__main__":
    main()
