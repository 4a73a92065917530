"""Soak test: a bounded storm of good, impatient and malformed requests (loopback only).

Each request is one of:
- stream:     a streamed chat completion, read to the end;
- plain:      a non-streamed completion;
- disconnect: a streamed chat completion the client drops after a few chunks;
- malformed:  a bad request (see MALFORMED), which must get an HTTP 4xx.
The server passes when it finishes every stream/plain request, rejects every
malformed one with a 4xx, still answers afterwards, and its memory (RSS of the
server's whole process tree) settles: rounds run back to back, and the growth
over the later rounds is reported beside the total.

    python -m tpu_models.benchmarks.soak [--base-url URL --server-pid PID | --model DIR]
        [--requests 1000] [--concurrency 200] [--rounds 3] [--time-limit 900]
"""

import argparse
import asyncio
import collections
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHARES = {"stream": 0.45, "plain": 0.30, "disconnect": 0.15, "malformed": 0.10}
PROMPTS = ["Alice is 30 and lives in Paris", "A red kettle that costs 40 dollars",
           "Omar works as a pilot at Globex for 12 years", "Write a JSON object about Bob"]


def malformed_requests(model: str, max_model_len: int) -> dict[str, tuple[str, bytes]]:
    """name -> (path, raw body): each must be refused with a 4xx."""
    def body(**fields):
        return json.dumps(fields).encode()

    chat = [{"role": "user", "content": "hi"}]
    return {
        "prompt over max-model-len": ("/v1/completions", body(
            model=model, prompt=[5] * (max_model_len + 1), max_tokens=4)),
        "max_tokens 0": ("/v1/completions", body(model=model, prompt="hi", max_tokens=0)),
        "max_tokens over max-model-len": ("/v1/chat/completions", body(
            model=model, messages=chat, max_tokens=max_model_len * 100)),
        "unknown model": ("/v1/completions", body(model="no-such-model", prompt="hi")),
        "invalid JSON": ("/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": '),
        "invalid schema": ("/v1/chat/completions", body(
            model=model, messages=chat, max_tokens=4, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})),
        "non-UTF-8 body": ("/v1/completions", b'{"model": "' + model.encode()
                           + b'", "prompt": "\xff\xfe", "max_tokens": 4}'),
        "empty prompt": ("/v1/completions", body(model=model, prompt="", max_tokens=4)),
    }


@dataclasses.dataclass
class Outcome:
    kind: str
    status: str  # completed | failed | rejected | accepted-bad | disconnected
    latency: float = 0.0
    ttft: float = 0.0
    detail: str = ""


async def _stream(client, model, prompt, max_tokens, drop_after=None) -> Outcome:
    kind = "stream" if drop_after is None else "disconnect"
    start, ttft, chunks, finish = time.perf_counter(), 0.0, 0, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0.8, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and not ttft:
                ttft = time.perf_counter() - start
            chunks += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if drop_after is not None and chunks >= drop_after:
                await stream.close()  # hang up mid-stream
                return Outcome(kind, "disconnected", time.perf_counter() - start, ttft)
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        return Outcome(kind, "failed", detail=f"{type(e).__name__}: {e}"[:300])
    if finish not in ("stop", "length"):
        return Outcome(kind, "failed", detail=f"stream ended without finish_reason ({finish})")
    return Outcome(kind, "completed", time.perf_counter() - start, ttft)


async def _plain(client, model, prompt, max_tokens) -> Outcome:
    start = time.perf_counter()
    try:
        reply = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                temperature=0.8)
    except Exception as e:  # noqa: BLE001
        return Outcome("plain", "failed", detail=f"{type(e).__name__}: {e}"[:300])
    if reply.choices[0].finish_reason not in ("stop", "length"):
        return Outcome("plain", "failed", detail=f"finish_reason {reply.choices[0].finish_reason}")
    return Outcome("plain", "completed", time.perf_counter() - start)


async def _malformed(http, name, path, body) -> Outcome:
    start = time.perf_counter()
    try:
        response = await http.post(path, content=body,
                                   headers={"Content-Type": "application/json"})
    except Exception as e:  # noqa: BLE001
        return Outcome("malformed", "failed", detail=f"{name}: {type(e).__name__}: {e}"[:300])
    status = "rejected" if 400 <= response.status_code < 500 else "accepted-bad"
    return Outcome("malformed", status, time.perf_counter() - start,
                   detail=f"{name}: HTTP {response.status_code} {response.text[:160]}")


def server_rss(pid: int | None) -> int | None:
    """Resident bytes of the server process and all its children (engine core, ...)."""
    if pid is None:
        return None
    import psutil
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        return None


async def soak_round(base_url, api_key, model, max_model_len, kinds, concurrency, max_tokens,
                     deadline, seed) -> list[Outcome]:
    import httpx
    from openai import AsyncOpenAI

    rng = random.Random(seed)
    bad = list(malformed_requests(model, max_model_len).items())
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, timeout=600, max_retries=0)
    http = httpx.AsyncClient(base_url=base_url, timeout=120,
                             headers={"Authorization": f"Bearer {api_key}"})
    limit = asyncio.Semaphore(concurrency)

    async def one(i, kind):
        async with limit:
            if time.monotonic() > deadline:
                return Outcome(kind, "skipped")
            prompt = rng.choice(PROMPTS)
            if kind == "stream":
                return await _stream(client, model, prompt, max_tokens)
            if kind == "disconnect":
                return await _stream(client, model, prompt, max_tokens,
                                     drop_after=rng.randint(1, 3))
            if kind == "plain":
                return await _plain(client, model, prompt, max_tokens)
            name, (path, body) = bad[i % len(bad)]
            return await _malformed(http, name, path, body)

    try:
        return await asyncio.gather(*[one(i, k) for i, k in enumerate(kinds)])
    finally:
        await client.close()
        await http.aclose()


def run(base_url: str, *, api_key: str = "unused", model: str | None = None,
        server_pid: int | None = None, requests: int = 1000, concurrency: int = 200,
        rounds: int = 3, max_tokens: int = 32, max_model_len: int = 256,
        time_limit: float = 900, seed: int = 0) -> dict:
    import requests as http

    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"}
    if model is None:
        model = http.get(f"{base_url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    rng = random.Random(seed)
    per_round = max(1, requests // rounds)
    deadline = time.monotonic() + time_limit
    rss = [server_rss(server_pid)]
    outcomes, start = [], time.perf_counter()
    for r in range(rounds):
        kinds = rng.choices(list(SHARES), weights=list(SHARES.values()), k=per_round)
        outcomes += asyncio.run(soak_round(base_url, api_key, model, max_model_len, kinds,
                                           concurrency, max_tokens, deadline, seed + r))
        rss.append(server_rss(server_pid))
    duration = time.perf_counter() - start
    healthy = http.get(f"{base_url}/health", timeout=10).status_code == 200
    after = http.post(f"{base_url}/v1/completions", headers=headers, timeout=120, json={
        "model": model, "prompt": PROMPTS[0], "max_tokens": 4}).status_code
    return summarize(outcomes, rss, duration, healthy and after == 200, concurrency)


def summarize(outcomes, rss, duration, serving_after, concurrency) -> dict:
    counts = collections.Counter((o.kind, o.status) for o in outcomes)
    latencies = np.array([o.latency for o in outcomes if o.status == "completed"])
    ttfts = np.array([o.ttft for o in outcomes if o.status == "completed" and o.ttft])

    def pct(values):
        if not len(values):
            return {}
        return {"mean": float(values.mean()),
                **{f"p{p}": float(np.percentile(values, p)) for p in (50, 90, 99)}}

    valid = sum(v for (k, s), v in counts.items() if k in ("stream", "plain") and s != "skipped")
    known = [r for r in rss if r is not None]
    return {
        "benchmark": "soak", "requests": len(outcomes), "concurrency": concurrency,
        "duration_s": duration,
        # Of the streams and plain completions: a request meant to be dropped may finish
        # (end of text) before the client hangs up, and counts under by_kind only.
        "completed": sum(v for (k, s), v in counts.items()
                         if k in ("stream", "plain") and s == "completed"),
        "valid": valid,
        "failed": sum(v for (k, s), v in counts.items() if s == "failed"),
        "rejected": counts[("malformed", "rejected")],
        "malformed": sum(v for (k, s), v in counts.items() if k == "malformed" and s != "skipped"),
        "accepted_bad": counts[("malformed", "accepted-bad")],
        "disconnected": counts[("disconnect", "disconnected")],
        "skipped": sum(v for (k, s), v in counts.items() if s == "skipped"),
        "by_kind": {f"{k}/{s}": v for (k, s), v in sorted(counts.items())},
        "latency_s": pct(latencies), "ttft_s": pct(ttfts),
        "rss_bytes_per_round": rss,
        "rss_growth_total": known[-1] / known[0] - 1 if len(known) > 1 else None,
        "rss_growth_last_round": known[-1] / known[-2] - 1 if len(known) > 2 else None,
        "serving_after": serving_after,
        "errors": sorted({o.detail for o in outcomes if o.status in ("failed", "accepted-bad")})[:10],
    }


def passed(report: dict) -> bool:
    return (report["failed"] == 0 and report["accepted_bad"] == 0
            and report["completed"] == report["valid"] and report["serving_after"])


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"soak: {report['requests']} requests at concurrency "
                        f"{report['concurrency']} in {report['duration_s']:.0f} s")
    table.add_column("outcome")
    table.add_column("count", justify="right")
    for key, value in report["by_kind"].items():
        table.add_row(key, str(value))
    console = Console(width=120)
    console.print(table)
    lat, ttft = report["latency_s"], report["ttft_s"]
    if lat:
        console.print(f"latency s: mean {lat['mean']:.2f}  p50 {lat['p50']:.2f}  "
                      f"p90 {lat['p90']:.2f}  p99 {lat['p99']:.2f}")
    if ttft:
        console.print(f"TTFT s:    mean {ttft['mean']:.2f}  p50 {ttft['p50']:.2f}  "
                      f"p90 {ttft['p90']:.2f}  p99 {ttft['p99']:.2f}")
    rss = [f"{r / 2**20:.0f}" if r else "?" for r in report["rss_bytes_per_round"]]
    console.print(f"server RSS MiB (start, after each round): {', '.join(rss)}")
    for error in report["errors"]:
        console.print(f"  error: {error}")
    console.print("PASS" if passed(report) else "FAIL")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--base-url", help="a running server (loopback)")
    target.add_argument("--model", help="start `tpu-models serve MODEL` (default: the demo)")
    parser.add_argument("--server-pid", type=int, help="with --base-url: measure its RSS")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=256,
                        help="the server's --max-model-len (sizes the over-long prompt)")
    parser.add_argument("--time-limit", type=float, default=900)
    parser.add_argument("--out", default="soak.json")
    args = parser.parse_args(argv)
    server = None
    if args.base_url:
        base_url = args.base_url
        if not base_url.startswith(("http://127.", "http://localhost", "http://[::1]")):
            sys.exit("soak: loopback servers only (http://127.0.0.1:PORT)")
    else:
        from tpu_models.harness.serve_process import Server
        log = Path(tempfile.mkdtemp(prefix="soak-")) / "serve.log"
        server = Server(args.model, "--dtype", "float32", "--max-model-len",
                        str(args.max_model_len), log=log, api_key="soak-key").start()
        base_url, args.api_key, args.server_pid = server.url, "soak-key", server.process.pid
    try:
        report = run(base_url, api_key=args.api_key, server_pid=args.server_pid,
                     requests=args.requests, concurrency=args.concurrency, rounds=args.rounds,
                     max_tokens=args.max_tokens, max_model_len=args.max_model_len,
                     time_limit=args.time_limit)
    finally:
        if server:
            server.stop()
    print_report(report)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("by_kind", "errors")}))
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
