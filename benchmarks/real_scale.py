"""`tpu-models bench real-scale`: what a user gets at real size, in one run.

For each shape (a Qwen3-0.6B-shaped Qwen3-structural, a Gemma 3 1B-shaped
model; random weights stored in bf16, as released), side by side:

  model step   one decode step (forward + logits, batch 1) at the model level,
               and the host's bandwidth limit for it (benchmarks/step.py, run
               in its own process)
  served       `tpu-models serve` (float32 off-TPU), one request at a time:
               decode time per token from 8 against 72 generated tokens
               (medians of 3), and vLLM's own mean TPOT from /metrics
  memory       peak memory (PSS) of the server's process tree while loading
               (until vLLM sizes the KV cache) and over the whole start-up,
               against the weights and the KV cache it was given

    python -m tpu_models.benchmarks.real_scale [--shape qwen3-0.6b,gemma3-1b] [--out FILE]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tpu_models.harness.random_checkpoints import SHAPES, random_checkpoint
from tpu_models.harness.serve_process import TreeMemory

PROMPT_TOKENS = 16
SHORT, LONG = 8, 72
KV_CACHE_BYTES = 1 << 30


def model_step(shape: str, context: int, work: Path) -> dict:
    """bench step's batch-1 row for `shape`, measured in a process of its own."""
    out = work / f"step-{shape}.json"
    subprocess.run([sys.executable, "-m", "tpu_models.benchmarks.step", "--shape", shape, "--batch", "1",
                    "--context", str(context), "--repeats", "5", "--out", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    row = json.loads(out.read_text())["rows"][0]
    return {"step_ms": row["step_ms"], "limit_ms": row["limit_ms"], "weight_mb": row["weight_mb"]}


def served(model: Path, work: Path, name: str) -> dict:
    from tpu_models.benchmarks.serving import server_counters
    from tpu_models.harness.serve_process import Server

    server = Server(model, "--max-model-len", "512", "--max-num-seqs", "8",
                    "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--served-model-name", name,
                    log=work / f"serve-{name}.log").launch()
    memory = TreeMemory(server.process.pid)
    try:
        server.kv_capacity()  # logged once the weights are in and the KV cache is sized
        peak_load = memory.peak
        server.start()
        peak_start = memory.stop()
        ready = memory.now()
        client = server.client()
        prompt = list(range(2, 2 + PROMPT_TOKENS))

        def request(tokens: int) -> float:
            start = time.perf_counter()
            reply = client.completions.create(model=name, prompt=prompt, max_tokens=tokens,
                                              temperature=0, extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == tokens
            return time.perf_counter() - start

        request(SHORT), request(LONG)  # warm-up
        tpot = ("vllm:request_time_per_output_token_seconds_sum",
                "vllm:request_time_per_output_token_seconds_count")
        before = server_counters(server.url, tpot)
        short = statistics.median(request(SHORT) for _ in range(3))
        long = statistics.median(request(LONG) for _ in range(3))
        after = server_counters(server.url, tpot)
    finally:
        server.stop()
    count = after[tpot[1]] - before[tpot[1]]
    return {"startup_s": server.startup_seconds,
            "decode_ms_per_token": (long - short) / (LONG - SHORT) * 1e3,
            "vllm_mean_tpot_ms": (after[tpot[0]] - before[tpot[0]]) / count * 1e3 if count else None,
            "load_peak_pss_gib": peak_load / 2**30, "startup_peak_pss_gib": peak_start / 2**30,
            "ready_pss_gib": ready / 2**30,
            "kv_cache_gib": KV_CACHE_BYTES / 2**30}


def report(rows: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="real-scale serving, batch 1 (float32 off-TPU)")
    for column in ("shape", "model step ms", "limit ms", "served ms/token", "vLLM TPOT ms",
                   "served / step", "start-up s", "weights GiB", "KV GiB", "peak PSS loading GiB",
                   "peak PSS start-up GiB"):
        table.add_column(column, justify="right")
    for shape, r in rows.items():
        table.add_row(shape, f"{r['step_ms']:.0f}", f"{r['limit_ms']:.0f}",
                      f"{r['decode_ms_per_token']:.0f}", "-" if r["vllm_mean_tpot_ms"] is None else f"{r['vllm_mean_tpot_ms']:.0f}",
                      f"{r['served_over_step']:.2f}", f"{r['startup_s']:.0f}",
                      f"{r['weight_mb'] / 1024:.2f}", f"{r['kv_cache_gib']:.2f}",
                      f"{r['load_peak_pss_gib']:.2f}", f"{r['startup_peak_pss_gib']:.2f}")
    Console(width=150).print(table)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="tpu-models bench real-scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b,gemma3-1b",
                   help=f"comma-separated, of: {', '.join(SHAPES)}")
    p.add_argument("--context", type=int, default=64, help="context of the model-level step")
    p.add_argument("--out", default="bench-real-scale.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tpu-models-real-"))
    rows = {}
    for shape in args.shape.split(","):
        model = random_checkpoint(shape, work / shape)
        row = model_step(shape, args.context, work) | served(model, work, shape)
        row["served_over_step"] = row["decode_ms_per_token"] / row["step_ms"]
        rows[shape] = row
        print(json.dumps({shape: row}), flush=True)
    report(rows)
    Path(args.out).write_text(json.dumps({"benchmark": "real-scale", "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    from tpu_models import host
    host.setup_host()
    main()
