"""This tree against another revision, served side by side in one run.

Both trees serve the same checkpoint at once (the other revision's files from
`git archive`, laid out as its pyproject installs them, first on PYTHONPATH);
the serving benchmark alternates between them, `rounds` runs each per
concurrency, which goes first swapping every round. Reported per concurrency:
each side's median output tokens/s and TPOT, and the median of the rounds'
ratios (this tree / base): a shared host drifts, a ratio within one round does
much less.

    tpu-models bench ab --base REV [--model DIR|demo | --shape qwen3-0.6b]
        [--server-args "--speculative eagle3"] [--concurrency 1,4] [--rounds 3]
"""

import argparse
import contextlib
import io
import json
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

# The repository this file is in, however it is laid out (git archive of a
# subdirectory would archive only that subdirectory).
REPO = Path(__file__).resolve().parent


def checkout(rev: str, into: Path) -> tuple[Path, str]:
    """(PYTHONPATH entry, the `tpu-models` CLI module) of revision `rev`, laid out in `into`."""
    root = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--show-toplevel"], check=True,
                          capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "-C", root, "archive", rev], check=True,
                             capture_output=True).stdout
    tree = into / "tree"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    project = tomllib.loads((tree / "pyproject.toml").read_text())
    cli = project["project"]["scripts"]["tpu-models"].split(":")[0]
    package_dir = project.get("tool", {}).get("setuptools", {}).get("package-dir")
    if not package_dir:
        return tree, cli  # the folders are the top-level packages
    site = into / "site"
    import shutil
    shutil.copytree(tree / "tpu_models", site / "tpu_models")
    for package, folder in package_dir.items():
        shutil.copytree(tree / folder, site.joinpath(*package.split(".")), dirs_exist_ok=True)
    return site, cli


def checkpoint(args, work: Path) -> str | None:
    if args.shape:
        from tpu_models.harness.random_checkpoints import random_checkpoint
        return str(random_checkpoint(args.shape, work / args.shape))
    if args.model == "demo":
        return None
    if args.model:
        return args.model
    from tpu_models.benchmarks.compare import DEFAULT_SHAPE, make_pair
    ours, _ = make_pair(work, DEFAULT_SHAPE)
    return str(ours)


def vocab_size(model: str | None) -> int:
    from tpu_models.server.serve import DEFAULT_MODEL
    config = json.loads((Path(model or DEFAULT_MODEL) / "config.json").read_text())
    return config["vocab_size"]


def measure(args) -> dict:
    from tpu_models.benchmarks import serving
    from tpu_models.harness.serve_process import Server

    work = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    base_path, base_cli = checkout(args.base, work / "base")
    model = checkpoint(args, work)
    server_args = ["--served-model-name", "bench", "--max-model-len",
                   str(args.input_len + args.output_len + 16), *shlex.split(args.server_args)]
    sides = {
        "this tree": dict(),
        f"base {args.base}": dict(command=[sys.executable, "-m", base_cli, "serve"],
                                  env={"PYTHONPATH": str(base_path)}, cwd=base_path),
    }
    runs = {side: [] for side in sides}
    servers = {side: Server(model, *server_args, log=work / f"{i}.log", **how)
               for i, (side, how) in enumerate(sides.items())}
    with _launched(servers):
        for concurrency in args.concurrency:
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for side in order:
                    runs[side] += serving.sweep(
                        servers[side].url, "bench", vocab_size=vocab_size(model),
                        input_len=args.input_len, output_len=args.output_len,
                        num_prompts=args.num_prompts or serving.default_num_prompts(concurrency),
                        concurrencies=[concurrency], avoid_tokens={0, 1}, seed=r)
    this, base = sides
    rows = []
    for concurrency in args.concurrency:
        mine = [row for row in runs[this] if row["concurrency"] == concurrency]
        theirs = [row for row in runs[base] if row["concurrency"] == concurrency]
        rows.append({
            "concurrency": concurrency,
            "this_tok_s": statistics.median(r["output_throughput"] for r in mine),
            "base_tok_s": statistics.median(r["output_throughput"] for r in theirs),
            "this_tpot_ms": statistics.median(r["median_tpot_ms"] for r in mine),
            "base_tpot_ms": statistics.median(r["median_tpot_ms"] for r in theirs),
            "ratio": statistics.median(ratios) if (ratios := _ratios(mine, theirs)) else None,
            "round_ratios": ratios,
            "failed": sum(r["failed"] for r in mine + theirs)})
    return {"benchmark": "ab", "base": args.base, "base_tree": str(base_path),
            "model": args.shape or args.model or "compare",
            "server_args": args.server_args, "rounds": args.rounds, "input_len": args.input_len,
            "output_len": args.output_len, "logs": str(work), "rows": rows}


def _ratios(mine: list[dict], theirs: list[dict]) -> list[float]:
    """This tree / base, a round each, of the rounds in which both sides served."""
    return [a["output_throughput"] / b["output_throughput"] for a, b in zip(mine, theirs)
            if a["output_throughput"] and b["output_throughput"]]


@contextlib.contextmanager
def _launched(servers):
    from tpu_models.harness.serve_process import launched
    with launched(servers):
        for server in servers.values():
            server.start()
        yield


def report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"{result['model']} {result['server_args']}: this tree vs "
                        f"{result['base']}, {result['input_len']} in / {result['output_len']} "
                        f"out, medians of {result['rounds']} alternated rounds")
    for column in ("conc", "this tok/s", "base tok/s", "this / base (median of rounds)",
                   "rounds", "TPOT this / base ms", "failed"):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        table.add_row(str(r["concurrency"]), f"{r['this_tok_s']:.1f}", f"{r['base_tok_s']:.1f}",
                      "no round served" if r["ratio"] is None else f"{r['ratio']:.3f}",
                      " ".join(f"{x:.2f}" for x in r["round_ratios"]),
                      f"{r['this_tpot_ms']:.2f} / {r['base_tpot_ms']:.2f}", str(r["failed"]))
    Console(width=150).print(table)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="tpu-models bench ab", description=__doc__.split("\n")[0])
    p.add_argument("--base", default="HEAD~1", help="git revision to compare against")
    p.add_argument("--model", help="checkpoint directory, or 'demo' (default: bench compare's "
                                   "random Qwen3-structural)")
    p.add_argument("--shape", help="a random checkpoint of a real shape (qwen3-0.6b, gemma3-1b)")
    p.add_argument("--server-args", default="", help="extra arguments for both servers")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--out", default="bench-ab.json")
    args = p.parse_args(argv)
    result = measure(args)
    report(result)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"benchmark": "ab", "rows": [
        {k: r[k] for k in ("concurrency", "ratio", "failed")} for r in result["rows"]]}))
    return result


if __name__ == "__main__":
    main()
