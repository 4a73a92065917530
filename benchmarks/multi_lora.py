"""Adapters chosen per request against one adapter merged at load, side by side.

    tpu-models bench lora [--adapters 4] [--rank 16] [--concurrency 1,4,16]
                          [--input-len 64] [--output-len 64] [--out FILE]

Two servers of the embedded demo model, one after the other, same options:
`merged` (`tpu-models serve --lora A0`: the adapter folded into the weights,
no per-token cost) and `slots` (`--enable-lora --max-loras N --lora-modules
a0=A0 ...`: every adapter in a device slot, each token picking its own), the
requests spread round-robin over the N adapters. Adapters are random PEFT
adapters of --rank on every projection (q/k/v/o/gate/up/down). Reported per
concurrency: output tok/s and median TPOT (vLLM bench serve's definitions,
benchmarks/serving.py), and slots against merged in the same run.
"""

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import torch

from tpu_models.benchmarks import serving
from tpu_models.harness.serve_process import Server
from tpu_models.server.serve import DEFAULT_MODEL, DEFAULT_NAME

SERVER_ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(128 << 20)]


def random_adapters(base: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT adapters of `rank` on every projection of `base`, weights
    large enough to change its answers."""
    from tpu_models.loaders.peft import LoraAdapter
    from tpu_models.loaders.tables import PROJECTIONS, read_config
    from tpu_models import registry

    config, _ = read_config(base)
    table, _ = registry.for_config(config).hf_table(config)
    targets = {n: s for n, s in table.items() if n.split(".")[-2] in PROJECTIONS}
    paths = []
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for name, (rows, cols) in sorted(targets.items()):
            module = name.removesuffix(".weight")
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, cols, generator=g) / cols**0.5
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.02
        peft = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                "target_modules": sorted({n.split(".")[-2] for n in targets})}
        paths.append(LoraAdapter.from_tensors(peft, tensors, f"random adapter {i}")
                     .save(out / f"a{i}"))
    return paths


def measure(name: str, args: list[str], models: list[str], prompts: dict[int, list],
            warmup: list, output_len: int, work: Path) -> list[dict]:
    """One server: a row per concurrency (the keys of `prompts`)."""
    with Server(None, *SERVER_ARGS, *args, log=work / f"serve-{name}.log") as server:

        async def run(concurrency):
            client = serving.bench_client(server.url, server.api_key or "unused")
            turn = iter(range(1 << 30))

            def send(prompt):  # round-robin over the adapters
                return serving.one_request(client, models[next(turn) % len(models)], prompt,
                                           output_len)

            await serving.run_load(send, warmup, concurrency=len(models))
            results, duration = await serving.run_load(send, prompts[concurrency],
                                                       concurrency=concurrency)
            await client.close()
            return {"server": name, "concurrency": concurrency, "adapters": len(models),
                    **serving.metrics(results, duration)}

        return [asyncio.run(run(c)) for c in prompts]


def report(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="per-request adapters (slots) vs one merged at load, demo model")
    for header in ("server", "adapters", "conc", "done", "out tok/s", "vs merged", "TPOT p50 ms"):
        table.add_column(header, justify="right")
    for r in rows:
        table.add_row(r["server"], str(r["adapters"]), str(r["concurrency"]), str(r["completed"]),
                      f"{r['output_throughput']:.1f}", f"{r['vs_merged']:.2f}x",
                      f"{r['median_tpot_ms']:.2f}")
    Console(width=140).print(table)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="tpu-models bench lora", description=__doc__.split("\n")[0])
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16, choices=[8, 16, 32, 64])
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default="bench-lora.json")
    args = p.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="tpu-models-lora-"))
    adapters = random_adapters(DEFAULT_MODEL, work, args.adapters, args.rank)
    vocab = json.loads((DEFAULT_MODEL / "config.json").read_text())["vocab_size"]
    # The same prompts for both servers; none repeats (the prefix cache would answer it).
    prompts = {c: serving.random_prompts(serving.default_num_prompts(c), args.input_len, vocab,
                                         [c, 2]) for c in concurrencies}
    warmup = serving.random_prompts(2 * args.adapters, args.input_len, vocab, [0, 1])
    names = [f"a{i}" for i in range(args.adapters)]
    rows = measure("merged", ["--lora", str(adapters[0])], [DEFAULT_NAME], prompts, warmup,
                   args.output_len, work)
    rows += measure("slots", ["--enable-lora", "--max-loras", str(args.adapters),
                              "--max-lora-rank", str(args.rank), "--lora-modules",
                              *[f"{n}={a}" for n, a in zip(names, adapters)]],
                    names, prompts, warmup, args.output_len, work)
    merged = {r["concurrency"]: r["output_throughput"] for r in rows if r["server"] == "merged"}
    for r in rows:
        r["vs_merged"] = r["output_throughput"] / merged[r["concurrency"]]
    report(rows)
    document = {"benchmark": "lora", "rank": args.rank, "input_len": args.input_len,
                "output_len": args.output_len, "logs": str(work), "rows": rows}
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    return document


if __name__ == "__main__":
    main()
