"""What the penalties cost: one server, the same load with and without them.

Every request of a run carries the same sampling fields; runs alternate between
the variants, `rounds` each, which goes first rotating every round. Reported: each
variant's median output tokens/s and TPOT, and the median of the rounds' ratios to
plain greedy requests (a shared host drifts, a ratio within one round much less).
The variants:
  plain      tpu-inference's own sampler
  extended   our sampler, asked for by a no-op logit_bias (host metadata, no counts)
  penalized  repetition, frequency and presence penalties (the device's token counts)

    tpu-models bench penalties [--shape qwen3-0.6b | --model DIR] [--concurrency 16]

Beside drafts (--server-args "--speculative-config ..."), vLLM refuses logit_bias:
pass --variants plain,penalized.
"""

import argparse
import shlex
import statistics
import tempfile
from pathlib import Path

VARIANTS = {
    "plain": {},
    "extended": {"logit_bias": {"0": 0.0}},
    "penalized": {"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.2},
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpu-models bench penalties", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--shape", default="qwen3-0.6b",
                        help="random-weight checkpoint of a real shape (default qwen3-0.6b)")
    target.add_argument("--model", help="a checkpoint directory instead")
    p.add_argument("--dtype", default="float32",
                   help="served dtype (XLA:CPU's bf16 matmuls are ~12x slower than fp32)")
    p.add_argument("--server-args", default="", help="extra arguments for the server")
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")],
                   default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, help="per run (default: 2 waves, at least 8)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", type=lambda t: t.split(","), default=list(VARIANTS),
                   help=f"a subset of {','.join(VARIANTS)} (plain is the reference)")
    p.add_argument("--out", default="bench-penalties.json")
    return p


def measure(args) -> dict:
    import json

    from tpu_models.benchmarks import serving
    from tpu_models.harness.serve_process import Server

    work = Path(tempfile.mkdtemp(prefix="bench-penalties-"))
    model = args.model
    if model is None:
        from tpu_models.harness.random_checkpoints import random_checkpoint
        model = str(random_checkpoint(args.shape, work / args.shape))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    variants = {v: VARIANTS[v] for v in VARIANTS if v in args.variants or v == "plain"}
    runs = {variant: [] for variant in variants}
    with Server(model, "--served-model-name", "bench", "--dtype", args.dtype,
                "--max-model-len", str(args.input_len + args.output_len + 16),
                *shlex.split(args.server_args), log=work / "serve.log") as server:
        for concurrency in args.concurrency:
            num = args.num_prompts or max(8, 2 * concurrency)
            # One run of each first: the extended sampler compiles for the batch sizes.
            for variant, sampling in variants.items():
                serving.sweep(server.url, "bench", vocab_size=vocab, input_len=args.input_len,
                              output_len=args.output_len, num_prompts=concurrency, warmup=0,
                              concurrencies=[concurrency], avoid_tokens={0, 1}, seed=99,
                              sampling=sampling)
            for r in range(args.rounds):
                order = list(variants)
                order = order[r % len(order):] + order[:r % len(order)]
                for variant in order:
                    runs[variant] += serving.sweep(
                        server.url, "bench", vocab_size=vocab, input_len=args.input_len,
                        output_len=args.output_len, num_prompts=num, warmup=0,
                        concurrencies=[concurrency], avoid_tokens={0, 1}, seed=r,
                        sampling=variants[variant])
    rows = []
    for concurrency in args.concurrency:
        of = {v: [row for row in runs[v] if row["concurrency"] == concurrency] for v in variants}
        row = {"concurrency": concurrency, "failed": sum(r["failed"] for v in of for r in of[v])}
        for variant, mine in of.items():
            row[f"{variant}_tok_s"] = statistics.median(r["output_throughput"] for r in mine)
            row[f"{variant}_tpot_ms"] = statistics.median(r["median_tpot_ms"] for r in mine)
            row[f"{variant}_ratio"] = statistics.median(
                a["output_throughput"] / b["output_throughput"] for a, b in zip(mine, of["plain"]))
        rows.append(row)
    return {"benchmark": "penalties", "model": args.model or args.shape, "dtype": args.dtype,
            "server_args": args.server_args, "rounds": args.rounds, "input_len": args.input_len,
            "output_len": args.output_len, "variants": variants, "logs": str(work), "rows": rows}


def report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"{result['model']} ({result['dtype']}): {result['input_len']} in / "
                        f"{result['output_len']} out, medians of {result['rounds']} rotated rounds")
    table.add_column("conc", justify="right")
    for variant in result["variants"]:
        table.add_column(f"{variant} tok/s (x plain)", justify="right")
        table.add_column(f"{variant} TPOT ms", justify="right")
    table.add_column("failed", justify="right")
    for r in result["rows"]:
        cells = [str(r["concurrency"])]
        for variant in result["variants"]:
            cells += [f"{r[f'{variant}_tok_s']:.1f} ({r[f'{variant}_ratio']:.3f})",
                      f"{r[f'{variant}_tpot_ms']:.2f}"]
        table.add_row(*cells, str(r["failed"]))
    Console().print(table)


def main(argv=None) -> None:
    from tpu_models.benchmarks import serving
    args = parser().parse_args(argv)
    if unknown := set(args.variants) - set(VARIANTS):
        parser().error(f"--variants: no variant {', '.join(sorted(unknown))}")
    result = measure(args)
    report(result)
    serving.write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
