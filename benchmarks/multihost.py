"""Serving across local hosts against one process, the same model at the same tensor
parallel size: start-up to a healthy /health, output tok/s, and whether the greedy
tokens agree.

  one process   tpu-models serve MODEL -tp N, N fake CPU devices in one JAX process
  local hosts   tpu-models serve MODEL -tp N --local-hosts H: H Ray nodes, one JAX
                process each with N/H devices, tpu-inference's Ray executor

Rounds alternate the two, which goes first rotating; every start shares one JAX
compilation cache, so the first round is cold and the later ones warm (reported
apart). Medians, and the median of each round's ratio (local hosts / one process).

    tpu-models bench multihost [--model DIR | --shape qwen3-0.6b] [-tp 4] [--hosts 2]
"""

import argparse
import json
import os
import shlex
import statistics
import tempfile
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpu-models bench multihost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--model", help="a checkpoint directory (default: the demo model)")
    target.add_argument("--shape", help="a random-weight checkpoint of a real shape instead")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=4)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="the first is cold")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--server-args", default="")
    p.add_argument("--out", default="bench-multihost.json")
    return p


def _one_round(model: str, args, work: Path, order: list[str], r: int) -> dict:
    from tpu_models.benchmarks import serving
    from tpu_models.harness.serve_process import Server
    from tpu_models.multihost import with_devices

    tp = str(args.tensor_parallel_size)
    common = ("--served-model-name", "bench", "--dtype", "float32", "-tp", tp,
              "--max-model-len", str(args.input_len + args.output_len + 16),
              *shlex.split(args.server_args))
    extra = {"one process": ((), {"XLA_FLAGS": with_devices(os.environ.get("XLA_FLAGS", ""),
                                                            args.tensor_parallel_size)}),
             "local hosts": (("--local-hosts", str(args.hosts)), {})}
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    measured = {}
    for label in order:
        flags, env = extra[label]
        with Server(model, *common, *flags, env=env,
                    log=work / f"{label.replace(' ', '-')}-{r}.log") as server:
            rows = serving.sweep(server.url, "bench", vocab_size=vocab, input_len=args.input_len,
                                 output_len=args.output_len, num_prompts=2 * args.concurrency,
                                 warmup=1, concurrencies=[args.concurrency], seed=r)
            client = server.client()
            greedy = [client.completions.create(model="bench", prompt=[5 + i, 9, 13], max_tokens=8,
                                                temperature=0).choices[0].text for i in range(4)]
            measured[label] = {"ready_s": server.startup_seconds,
                               "tok_s": rows[0]["output_throughput"],
                               "failed": rows[0]["failed"], "greedy": greedy}
    return measured


def measure(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-multihost-"))
    os.environ["VLLM_XLA_CACHE_PATH"] = str(work / "jax-cache")  # cold first round, then warm
    model = args.model
    if args.shape:
        from tpu_models.harness.random_checkpoints import random_checkpoint
        model = str(random_checkpoint(args.shape, work / args.shape))
    if model is None:
        from tpu_models.server.serve import DEFAULT_MODEL
        model = str(DEFAULT_MODEL)
    labels = ["one process", "local hosts"]
    rounds = [_one_round(model, args, work, labels[r % 2:] + labels[:r % 2], r)
              for r in range(args.rounds)]
    summary = {}
    for phase, chosen in (("cold", rounds[:1]), ("warm", rounds[1:])):
        for key in ("ready_s", "tok_s"):
            for label in labels:
                values = [m[label][key] for m in chosen]
                summary[f"{phase} {label} {key}"] = statistics.median(values) if values else None
            ratios = [m["local hosts"][key] / m["one process"][key] for m in chosen]
            summary[f"{phase} ratio {key}"] = statistics.median(ratios) if ratios else None
    agree = all(m["local hosts"]["greedy"] == m["one process"]["greedy"] for m in rounds)
    return {"benchmark": "multihost", "model": args.shape or args.model or "demo",
            "tensor_parallel": args.tensor_parallel_size, "hosts": args.hosts,
            "rounds": rounds, "summary": summary, "greedy_agree": agree,
            "concurrency": args.concurrency, "input_len": args.input_len,
            "output_len": args.output_len, "logs": str(work)}


def report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    s = result["summary"]
    table = Table(title=f"{result['model']} at TP {result['tensor_parallel']}: one process vs "
                        f"{result['hosts']} local hosts ({len(result['rounds'])} rounds, the "
                        f"first cold); greedy tokens agree: {result['greedy_agree']}")
    for column in ("", "one process", "local hosts", "ratio"):
        table.add_column(column, justify="right")
    for phase in ("cold", "warm"):
        for key, unit in (("ready_s", "ready s"), ("tok_s", "output tok/s")):
            cells = [s[f"{phase} {label} {key}"] for label in ("one process", "local hosts")]
            if cells[0] is None:
                continue
            table.add_row(f"{phase} {unit}", *[f"{c:.1f}" for c in cells],
                          f"{s[f'{phase} ratio {key}']:.2f}")
    Console().print(table)


def main(argv=None) -> None:
    from tpu_models.benchmarks import serving
    args = parser().parse_args(argv)
    result = measure(args)
    report(result)
    serving.write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
