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

    python -m tpu_models.benchmarks.startup [MODEL] [--server-args "..."] [--out FILE]
"""

import argparse
import json
import re
import shlex
import tempfile
import time
from datetime import datetime
from pathlib import Path

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


def start_once(model: str | None, args: list[str], cache: Path, log: Path) -> dict:
    from tpu_models.benchmarks.process import Server
    server = Server(model, *args, log=log, env={"VLLM_XLA_CACHE_PATH": str(cache)})
    launched = time.time()
    server.start()
    ready = launched + server.startup_seconds
    try:
        result = phases(server.output(), launched, ready)
    finally:
        server.stop()
    result["total_s"] = server.startup_seconds
    return result


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
    Console().print(table)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="tpu-models bench startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="checkpoint directory (default: the embedded demo)")
    p.add_argument("--server-args", default="--max-model-len 256 --kv-cache-memory-bytes 268435456",
                   help="for `tpu-models serve`")
    p.add_argument("--out", default="bench-startup.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tpu-models-startup-"))
    server_args = shlex.split(args.server_args)
    runs = {}
    for run in ("cold", "warm"):
        runs[run] = start_once(args.model, server_args, work / "xla-cache", work / f"{run}.log")
    report(runs)
    document = {"benchmark": "startup", "model": args.model or "embedded demo",
                "server_args": server_args, "runs": runs}
    Path(args.out).write_text(json.dumps(document, indent=2))
    print(json.dumps({"benchmark": "startup",
                      **{run: round(r["total_s"], 1) for run, r in runs.items()}}))


if __name__ == "__main__":
    from tpu_models import host
    host.setup_host()
    main()
