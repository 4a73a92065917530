"""Speculative decoding on the demo model: off, n-gram lookup and EAGLE-3, side by side.

    tpu-models bench spec [--methods off,ngram,eagle3] [--concurrency 1,4]
                          [--requests 48] [--rounds 3] [--runs 1] [--sets novel,free]
                          [--model DIR --draft DIR] [--tokens K] [--out FILE]

Each method gets its own `tpu-models serve` of the embedded demo model (same
options); all serve at once, and the benchmark alternates between them,
`rounds` runs each per concurrency, the order rotating every round: this small
shared host drifts by 15-25% between minutes, which one method after the other
read as a speed-up or a loss. Each run sends held-out demo requests, greedy,
as streamed chat completions: per set, `novel` (template sentences whose
values training never showed: benchmarks/demo_sets.held_out) and `free` (the
frozen hand-written set: demo_data.free_held_out). Reported per method and concurrency:
output tok/s and median TPOT (vLLM bench serve's definitions,
benchmarks/serving.py), medians over the runs; the draft acceptance rate and
mean acceptance length from the server's own vllm:spec_decode_* counters; and
output tok/s against `off`, the median of each round's ratio. Every method must
also answer every request with the same text as `off` (greedy speculative
decoding is lossless); the worst round's count of equal answers is reported.
With --runs R the servers are started R times, each run alternating its own
rounds; a row then reports the median run (by its ratio to `off`) and every
run's ratio.
"""

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

from tpu_models.benchmarks import serving
from tpu_models.benchmarks.demo_sets import free_held_out, held_out
from tpu_models.harness.serve_process import Server
from tpu_models.server.serve import DEFAULT_NAME, SPECULATIVE

MAX_TOKENS = 64


def run_once(server: Server, method: str, examples: list[dict], warmup: list[dict] | None,
             concurrency: int) -> tuple[dict, list[str]]:
    """One run of all examples at `concurrency` (after warm-up requests, if given)."""

    async def run():
        client = serving.bench_client(server.url, server.api_key or "unused")

        def send(example):
            messages = [{"role": "user", "content": example["request"]}]
            return serving.one_chat_request(client, DEFAULT_NAME, messages, MAX_TOKENS)

        if warmup:
            await serving.run_load(send, warmup, concurrency=concurrency)
        before = serving.server_counters(server.url, serving.SPEC_COUNTERS)
        results, duration = await serving.run_load(send, examples, concurrency=concurrency)
        after = serving.server_counters(server.url, serving.SPEC_COUNTERS)
        await client.close()
        return ({"method": method, "concurrency": concurrency, "requests": len(examples),
                 **serving.metrics(results, duration),
                 **serving.spec_decode_metrics(before, after)},
                [r.text for r in results])

    return asyncio.run(run())


def _speculation(method: str, draft: str | None, tokens: int | None) -> list[str]:
    if method == "off":
        return []
    if method == "eagle3" and (draft or tokens):  # another draft, or another draft length
        return ["--speculative-config", json.dumps(
            {**SPECULATIVE["eagle3"], **({"model": draft} if draft else {}),
             **({"num_speculative_tokens": tokens} if tokens else {})})]
    return ["--speculative", method]


def measure(methods: list[str], sets: dict[str, list[dict]], warmup: list[dict],
            concurrencies: list[int], rounds: int, work: Path, model: str | None = None,
            draft: str | None = None, tokens: int | None = None) -> list[dict]:
    """One row per set, method and concurrency (methods[0] is the baseline)."""
    args = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
            *(["--served-model-name", DEFAULT_NAME] if model else [])]
    rows = []
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        servers = {method: stack.enter_context(Server(
            model, *args, *_speculation(method, draft, tokens),
            log=work / f"serve-{method}.log")) for method in methods}
        for (name, examples), concurrency in ((s, c) for s in sets.items() for c in concurrencies):
            runs = {method: [] for method in methods}  # [(row, texts)] per round
            for r in range(rounds):
                order = methods[r % len(methods):] + methods[:r % len(methods)]
                for method in order:
                    runs[method].append(run_once(servers[method], method, examples,
                                                 warmup if r == 0 else None, concurrency))
            base = runs[methods[0]]
            for method in methods:
                row = {"set": name, **serving.median_row([run for run, _ in runs[method]])}
                row["speedup"] = statistics.median(
                    run["output_throughput"] / off["output_throughput"]
                    for (run, _), (off, _) in zip(runs[method], base))
                row["same_text_as_off"] = min(
                    sum(a == b for a, b in zip(texts, off_texts))
                    for (_, texts), (_, off_texts) in zip(runs[method], base))
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("set", "method", "concurrency",
                                                       "output_throughput", "median_tpot_ms",
                                                       "speedup")}), flush=True)
    return rows


def median_runs(runs: list[list[dict]]) -> list[dict]:
    """Per set, method and concurrency: the run with the median ratio to off,
    with every run's ratio and output tok/s beside it."""
    rows = []
    for same in zip(*runs):
        ordered = sorted(same, key=lambda row: row["speedup"])
        row = dict(ordered[(len(ordered) - 1) // 2])
        row["runs_speedup"] = [r["speedup"] for r in same]
        row["runs_median_output_throughput"] = [r["output_throughput"] for r in same]
        row["same_text_as_off"] = min(r["same_text_as_off"] for r in same)
        rows.append(row)
    return rows


def report(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="speculative decoding, demo model, held-out requests (greedy)")
    for header in ("set", "method", "conc", "done", "out tok/s", "vs off", "runs vs off",
                   "TPOT p50 ms", "accepted", "accept len", "same text as off"):
        table.add_column(header, justify="right")
    for r in rows:
        runs = len(r["runs_output_throughput"])
        table.add_row(r["set"], r["method"], str(r["concurrency"]), f"{r['completed']}/{r['requests'] * runs}",
                      f"{r['output_throughput']:.1f}", f"{r['speedup']:.2f}x",
                      ", ".join(f"{x:.2f}" for x in r.get("runs_speedup", [r["speedup"]])),
                      f"{r['median_tpot_ms']:.2f}",
                      f"{r['draft_acceptance_rate']:.0%}" if "draft_acceptance_rate" in r else "-",
                      f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-",
                      f"{r['same_text_as_off']}/{r['requests']}")
    Console(width=160).print(table)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="tpu-models bench spec", description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="off,ngram,eagle3")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="alternated runs per method and concurrency")
    p.add_argument("--runs", type=int, default=1,
                   help="times the servers are started and the rounds run; rows: the median run")
    p.add_argument("--sets", default="novel,free",
                   help="novel: --requests template sentences with unseen values; free: the "
                        "frozen hand-written set, all of it")
    p.add_argument("--model", help="a demo model other than the shipped one (with --draft)")
    p.add_argument("--draft", help="its EAGLE-3 draft")
    p.add_argument("--tokens", type=int, help="EAGLE-3 draft tokens per step (shipped: "
                   f"{SPECULATIVE['eagle3']['num_speculative_tokens']})")
    p.add_argument("--out", default="bench-spec.json")
    args = p.parse_args(argv)
    if bool(args.model) != bool(args.draft):
        p.error("--model and --draft go together")
    # "off" first: the baseline every ratio and text is compared against.
    methods = ["off", *(m for m in args.methods.split(",") if m != "off")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    novel = held_out(args.requests + 8, novel=True)
    warmup = novel[args.requests:]
    build = {"novel": lambda: novel[:args.requests], "free": free_held_out}
    if unknown := set(args.sets.split(",")) - set(build):
        p.error(f"--sets: unknown {sorted(unknown)}; choose from {sorted(build)}")
    sets = {name: build[name]() for name in args.sets.split(",")}
    work = Path(tempfile.mkdtemp(prefix="tpu-models-spec-"))
    rows = median_runs([
        measure(methods, sets, warmup, concurrencies, args.rounds, work / f"run-{run}",
                args.model, args.draft, args.tokens) for run in range(args.runs)])
    report(rows)
    document = {"benchmark": "spec", "max_tokens": MAX_TOKENS, "rounds": args.rounds,
                "runs": args.runs, "eagle3_tokens": args.tokens or
                SPECULATIVE["eagle3"]["num_speculative_tokens"],
                "model": args.model or "embedded demo", "logs": str(work), "rows": rows}
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    return document


if __name__ == "__main__":
    main()
