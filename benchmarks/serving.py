"""Serving benchmark: drives an OpenAI-compatible server with the async openai client.

Metrics follow `vllm bench serve` (vllm/benchmarks/serve.py):
- TTFT: the request leaving the HTTP client to the first streamed chunk with
  choices (its text may be empty: a partial UTF-8 sequence); the openai
  client's own request building (under 1 ms) comes before, as it does before
  vLLM's aiohttp post;
- TPOT: (latency - TTFT) / (output tokens - 1), per request;
- ITL: gaps between consecutive streamed chunks, over all requests;
- E2EL: request start to its last token;
- throughputs: completed requests, output tokens and input+output tokens per
  second of the whole run's duration.
Prompts are random token ids of exactly `input_len` tokens; every request
generates exactly `output_len` tokens (ignore_eos, greedy: `vllm bench serve
--temperature 0`), and the server's usage counts are checked against both.
"""

import asyncio
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class Result:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = dataclasses.field(default_factory=list)
    error: str = ""
    text: str = ""


_sent: dict[str, float] = {}  # request id -> when httpx sent it


async def _stamp(request) -> None:  # httpx request hook
    _sent[request.headers["x-bench-request"]] = time.perf_counter()


async def one_request(client, model: str, prompt: list[int], output_len: int,
                      sampling: dict | None = None) -> Result:
    """One streamed completion of `output_len` tokens (greedy unless `sampling` says
    otherwise). The ids travel in extra_body, which the client sends as given:
    `prompt=` goes through its type-directed transform, one call per id (3.7 vs
    0.9 ms per 128-id request), client CPU taken from the cores the server shares."""
    result = await _streamed(client.completions, dict(
        model=model, prompt="", max_tokens=output_len, temperature=0.0,
        extra_body={"prompt": prompt, "ignore_eos": True, **(sampling or {})}))
    if result.ok and (result.prompt_tokens != len(prompt) or result.output_tokens != output_len):
        result.ok = False
        result.error = (f"token counts {result.prompt_tokens}/{result.output_tokens}, "
                        f"expected {len(prompt)}/{output_len}")
    return result


async def one_chat_request(client, model: str, messages: list[dict], max_tokens: int) -> Result:
    """One streamed greedy chat completion, ending where the model ends it."""
    return await _streamed(client.chat.completions, dict(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0))


async def _streamed(endpoint, request: dict) -> Result:
    """Streams one request; its SSE lines are read raw (json.loads, no typed
    chunk objects): on a small host the client shares the cores with the
    server, and typed chunks cost 2-3x the CPU."""
    result = Result()
    request_id = f"{id(result)}-{time.perf_counter_ns()}"
    try:
        async with endpoint.with_streaming_response.create(
                **request, stream=True, stream_options={"include_usage": True},
                extra_headers={"x-bench-request": request_id}) as stream:
            start = last = _sent.pop(request_id)
            async for line in stream.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise RuntimeError(f"error event: {chunk['error']}")
                # A chunk with choices is a token even when its text is empty (a
                # partial UTF-8 sequence, a special token), as vLLM's bench counts it.
                if choices := chunk.get("choices"):
                    piece = choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
                    result.text += piece or ""
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if usage := chunk.get("usage"):
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.output_tokens = usage["completion_tokens"]
        result.latency = last - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens"
    except Exception as e:  # a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    finally:
        _sent.pop(request_id, None)
    return result


SERVER_COUNTERS = ("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
                   "vllm:prompt_tokens_cached_total")


# vLLM's speculative-decoding counters (vllm:spec_decode_*), as `vllm bench serve` reads them.
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


def spec_decode_metrics(before: dict, after: dict) -> dict:
    """Draft acceptance between two reads of SPEC_COUNTERS: the share of draft
    tokens accepted, and the mean acceptance length (tokens per target step,
    the bonus token included, as vLLM reports it); {} when nothing was drafted."""
    drafts, tokens, accepted = (after[k] - before[k] for k in SPEC_COUNTERS)
    if not drafts:
        return {}
    return {"draft_acceptance_rate": accepted / tokens if tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts}


def server_counters(url: str, names=SERVER_COUNTERS) -> dict[str, float]:
    """A vLLM server's own counters `names` from its /metrics, summed over their label sets."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    counters = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in counters:
                counters[sample.name] += sample.value
    return counters


def default_num_prompts(concurrency: int) -> int:
    """Eight waves of `concurrency` requests, at least 48: enough for stable medians."""
    return max(48, 8 * concurrency)


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int | list[int] = 0,
                   avoid: set[int] = frozenset()) -> list[list[int]]:
    """`seed`: an int or a list of ints (numpy's SeedSequence entropy)."""
    rng = np.random.default_rng(seed)
    allowed = np.array([t for t in range(vocab_size) if t not in avoid])
    return [rng.choice(allowed, input_len).tolist() for _ in range(num)]


async def run_load(send, requests: list, *, concurrency: int | None = None,
                   request_rate: float = math.inf, seed: int = 0) -> tuple[list[Result], float]:
    """Awaits send(request) for every request, at most `concurrency` at once,
    arriving as a Poisson process of `request_rate` per second (inf: all at
    once). Returns (results, seconds)."""
    limit = asyncio.Semaphore(concurrency or len(requests))
    rng = np.random.default_rng(seed)

    async def limited(request):
        async with limit:
            return await send(request)

    start = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(limited(request)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.exponential(1.0 / request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def _stats(name: str, values_s: list[float]) -> dict:
    values = np.asarray(values_s or [0.0]) * 1000
    out = {f"mean_{name}_ms": float(values.mean())}
    out.update({("median" if p == 50 else f"p{p}") + f"_{name}_ms": float(np.percentile(values, p))
                for p in PERCENTILES})
    return out


def metrics(results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    m = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    m.update(_stats("ttft", [r.ttft for r in done]))
    m.update(_stats("tpot", tpots))
    m.update(_stats("itl", [x for r in done for x in r.itl]))
    m.update(_stats("e2el", [r.latency for r in done]))
    return m


def sweep(base_url: str, model: str, *, vocab_size: int, input_len: int, output_len: int,
          num_prompts: int, concurrencies: list[int], request_rate: float = math.inf,
          warmup: int = 2, seed: int = 0, avoid_tokens: set[int] = frozenset(),
          api_key: str = "unused", sampling: dict | None = None) -> list[dict]:
    """One run per concurrency (after `warmup` requests); returns a row of metrics each.
    `sampling`: request fields every request carries (e.g. a penalty)."""
    async def main():
        client = bench_client(base_url, api_key)

        def send(prompt):
            return one_request(client, model, prompt, output_len, sampling)

        # No prompt repeats within a sweep, nor between sweeps of different seeds or
        # concurrencies: a repeated prompt's prefill would come from the prefix cache.
        warm = random_prompts(warmup, input_len, vocab_size, [seed, 1], avoid_tokens)
        await run_load(send, warm, concurrency=warmup)
        rows = []
        for concurrency in concurrencies:
            prompts = random_prompts(num_prompts, input_len, vocab_size,
                                     [seed, 2, concurrency or 0], avoid_tokens)
            before = server_counters(base_url, SPEC_COUNTERS)
            results, duration = await run_load(send, prompts, concurrency=concurrency,
                                               request_rate=request_rate, seed=seed)
            spec = spec_decode_metrics(before, server_counters(base_url, SPEC_COUNTERS))
            rows.append({"concurrency": concurrency, "request_rate": request_rate,
                         "input_len": input_len, "output_len": output_len,
                         "num_prompts": num_prompts, **metrics(results, duration), **spec})
        await client.close()
        return rows

    return asyncio.run(main())


def median_row(rows: list[dict]) -> dict:
    """One row for several runs of the same load: each float metric's median,
    failures and completions summed, other fields from the first run, and every
    run's output throughput."""
    out = {key: value for key, value in rows[0].items() if not isinstance(value, float)}
    out.update({key: statistics.median(row[key] for row in rows) for key, value in rows[0].items()
                if isinstance(value, float)})
    out.update(failed=sum(row["failed"] for row in rows),
               completed=sum(row["completed"] for row in rows),
               runs_output_throughput=[row["output_throughput"] for row in rows])
    return out


def bench_client(base_url: str, api_key: str = "unused"):
    """The async openai client the benchmarks drive a server with (its requests time-stamped)."""
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, timeout=600, max_retries=0,
                       http_client=DefaultAsyncHttpxClient(event_hooks={"request": [_stamp]}))


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    columns = [("concurrency", "conc", "{:d}"), ("completed", "done", "{:d}"),
               ("failed", "failed", "{:d}"), ("request_throughput", "req/s", "{:.2f}"),
               ("output_throughput", "out tok/s", "{:.1f}"),
               ("total_token_throughput", "total tok/s", "{:.1f}"),
               ("median_ttft_ms", "TTFT p50 ms", "{:.1f}"), ("p99_ttft_ms", "TTFT p99", "{:.1f}"),
               ("median_tpot_ms", "TPOT p50 ms", "{:.2f}"), ("p99_tpot_ms", "TPOT p99", "{:.2f}"),
               ("median_itl_ms", "ITL p50 ms", "{:.2f}"), ("median_e2el_ms", "E2E p50 ms", "{:.0f}")]
    if any("mean_acceptance_length" in row for row in rows):  # speculative decoding
        columns += [("draft_acceptance_rate", "accepted", "{:.0%}"),
                    ("mean_acceptance_length", "accept len", "{:.2f}")]
    for _, header, _ in columns:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*[fmt.format(row[key]) if key in row else "-" for key, _, fmt in columns])
    Console(width=200).print(table)


def plot(rows_by_label: dict[str, list[dict]], path: Path) -> None:
    """Output throughput and median TPOT against concurrency, one line per label."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label, rows in rows_by_label.items():
        x = [r["concurrency"] for r in rows]
        left.plot(x, [r["output_throughput"] for r in rows], marker="o", label=label)
        right.plot(x, [r["median_tpot_ms"] for r in rows], marker="o", label=label)
    for ax, ylabel in ((left, "output tokens/s"), (right, "median TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")
