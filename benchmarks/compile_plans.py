"""`tpu-models bench compile`: deployments compiled for their TPUs, and ours against
tpu-inference's own Qwen3, by `tpu-models compile` (config-only checkpoints of
real shapes; no weights, no TPU).

    python -m tpu_models.benchmarks.compile_plans [--only NAME,...] [--out FILE]
    python -m tpu_models.benchmarks.compile_plans --vs-builtin [--out FILE]

The first compiles each deployment of DEPLOYMENTS and tabulates memory per
chip, KV capacity and the decode step's estimates. The second compiles a
Qwen3-0.6B-shaped Qwen3-structural and tpu-inference's built-in Qwen3 of the
same shape (head removed) at TP 8 on v6e-8, and compares every decode and
prefill program. Every time here is the TPU compiler's estimate, or HBM
bytes over the chip's bandwidth: estimates, never measurements.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tpu_models.harness.random_checkpoints import shape_config, word_tokenizer

LONG = ["--max-model-len", "32768"]
TP8 = ["--tensor-parallel-size", "8", *LONG]
# name -> (shape, topology, `tpu-models compile` options)
DEPLOYMENTS = {
    "qwen3-structural 0.6B": ("qwen3-0.6b", "v6e-8", TP8),
    "qwen3-structural 1.7B": ("qwen3-1.7b", "v6e-8", TP8),
    "qwen3-structural 4B": ("qwen3-4b", "v6e-8", TP8),
    "qwen3-structural 8B": ("qwen3-8b", "v6e-8", TP8),
    "qwen3-structural 8B int8 weights": ("qwen3-8b", "v6e-8", [*TP8, "--quant", "int8-weight-only"]),
    "qwen3-structural 8B fp8": ("qwen3-8b", "v6e-8", [*TP8, "--quant", "fp8"]),
    "qwen3-structural 8B fp8 KV cache": ("qwen3-8b", "v6e-8", [*TP8, "--kv-cache-dtype", "fp8"]),
    "qwen3-structural 8B TP 4": ("qwen3-8b", "v6e-4", ["--tensor-parallel-size", "4", *LONG]),
    "qwen3-structural 8B TP 4 fp8 KV cache": (
        "qwen3-8b", "v6e-4", ["--tensor-parallel-size", "4", *LONG, "--kv-cache-dtype", "fp8"]),
    "qwen3-structural 0.6B EAGLE-3": ("qwen3-0.6b", "v6e-8", [*TP8, "--speculative-config", "EAGLE3"]),
    "qwen3-structural 0.6B EAGLE-3 at 0.91": (
        "qwen3-0.6b", "v6e-8", [*TP8, "--speculative-config", "EAGLE3",
                                "--gpu-memory-utilization", "0.91"]),
    "gemma3 1B v5e-1": ("gemma3-1b", "v5e-1", LONG),
    "gemma3 1B v5e-1 at 0.87": ("gemma3-1b", "v5e-1", [*LONG, "--gpu-memory-utilization",
                                                             "0.87"]),
    "gemma3 1B v6e-1": ("gemma3-1b", "v6e-1", LONG),
    "gemma3 1B v5e-1 fp8 KV cache": ("gemma3-1b", "v5e-1", [*LONG, "--kv-cache-dtype", "fp8"]),
    "gemma3 1B v5e-1 LoRA": ("gemma3-1b", "v5e-1", [*LONG, "--enable-lora", "--max-loras", "4",
                                                    "--max-lora-rank", "16"]),
    "gemma3 4B v5e-1": ("gemma3-4b", "v5e-1", LONG),
    "gemma3 27B v6e-8": ("gemma3-27b", "v6e-8", TP8),
}
# The seeds' deployments and tpu-inference CI's Gemma 3 27B: docs/tpu-path.md's table.
SEEDS = ("qwen3-structural 0.6B", "qwen3-structural 1.7B", "qwen3-structural 4B",
         "qwen3-structural 8B", "gemma3 1B v5e-1", "gemma3 1B v5e-1 LoRA", "gemma3 4B v5e-1",
         "gemma3 27B v6e-8")


def config_directory(shape: str, directory: Path, architecture: str | None = None) -> Path:
    """A checkpoint directory with config.json and a tokenizer only, as for a deployment
    sized before its weights exist."""
    directory.mkdir(parents=True, exist_ok=True)
    config = shape_config(shape)
    if architecture:
        config["architectures"] = [architecture]
    config["max_position_embeddings"] = max(config.get("max_position_embeddings") or 0, 40960)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    word_tokenizer(config["vocab_size"]).save_pretrained(directory)
    return directory


def eagle3_draft(target: Path, directory: Path) -> Path:
    """A config-only EAGLE-3 draft for `target` (one layer, the target's width)."""
    from tpu_models.loaders.eagle3 import draft_config
    config = json.loads((target / "config.json").read_text())
    directory.mkdir(parents=True, exist_ok=True)
    draft = draft_config(config, aux_layers=(2, config["num_hidden_layers"] // 2,
                                             config["num_hidden_layers"] - 3),
                         intermediate_size=config["intermediate_size"], dtype="bfloat16")
    (directory / "config.json").write_text(json.dumps(draft, indent=1))
    return directory


def compile_one(model: Path, topology: str, options: list[str], out: Path) -> dict:
    command = [sys.executable, "-m", "tpu_models.server.cli", "compile", str(model),
               "--topology", topology, *options, "--json", str(out)]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    last = (done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or [""])[-1]
    if not out.exists():
        return {"status": done.returncode, "verdict": last, "seconds": round(seconds, 1)}
    report = json.loads(out.read_text())
    return {**report, "status": done.returncode, "verdict": last, "seconds": round(seconds, 1)}


def summary(name: str, report: dict) -> dict:
    row = {"deployment": name, "status": report["status"], "verdict": report["verdict"],
           "compile_seconds": report["seconds"]}
    if "per_chip" not in report:
        return row
    chip, roof = report["per_chip"], report["decode_roofline"]
    gib = 2**30
    return {**row, "topology": report["topology"], "fits": report["fits"],
            "programs": len(report["programs"]),
            "weights_gib": round(chip["weights_bytes"] / gib, 2),
            "kv_cache_gib": round(chip["kv_cache_bytes"] / gib, 2),
            "largest_temp_gib": round(chip["largest_program_temp_bytes"] / gib, 3),
            "largest_step_gib": round(chip.get("largest_program_transient_bytes", 0) / gib, 3),
            "largest_program": chip["largest_program"],
            "buffers_gib": round(chip["other_bytes"] / gib, 3),
            "free_gib": round(chip.get("free_bytes", 0) / gib, 3),
            "what_would_fit": report.get("what_would_fit"),
            "hbm_gib": round(chip["hbm_bytes"] / gib, 2),
            "kv_cache_tokens": report["kv_cache_tokens"],
            "requests_at_max_len": report["max_concurrent_requests"],
            "decode_estimate_ms": round((roof["compiler_estimate_seconds"] or 0) * 1e3, 3),
            "roofline_one_request_ms": round(roof["one_request_at_max_model_len_seconds"] * 1e3, 3),
            "roofline_full_cache_ms": round(roof["full_cache_seconds"] * 1e3, 3)}


def deployments(names: list[str], work: Path) -> list[dict]:
    rows = []
    for name in names:
        shape, topology, options = DEPLOYMENTS[name]
        model = config_directory(shape, work / shape)
        if "EAGLE3" in options:
            draft = eagle3_draft(model, work / f"{shape}-eagle3")
            options = [json.dumps({"method": "eagle3", "model": str(draft),
                                   "num_speculative_tokens": 4}) if o == "EAGLE3" else o
                       for o in options]
        report = compile_one(model, topology, options, work / f"{name.replace(' ', '_')}.json")
        rows.append(summary(name, report))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def print_deployments(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title="Deployments compiled for their TPUs (estimates, not measurements)")
    columns = [("deployment", "deployment"), ("topology", "topology"), ("fits", "fits"),
               ("weights GiB/chip", "weights_gib"), ("KV GiB/chip", "kv_cache_gib"),
               ("buffers GiB", "buffers_gib"), ("largest step GiB", "largest_step_gib"),
               ("free GiB", "free_gib"),
               ("KV tokens", "kv_cache_tokens"), ("32K requests", "requests_at_max_len"),
               ("decode est. ms", "decode_estimate_ms"),
               ("roofline 1 req ms", "roofline_one_request_ms"),
               ("compile s", "compile_seconds")]
    for title, _ in columns:
        table.add_column(title, justify="left" if title == "deployment" else "right")
    for row in rows:
        table.add_row(*(str(row.get(key, "")) for _, key in columns))
    Console(width=200).print(table)


# Programs a decode step runs (one token a request) and the prefill buckets.
def _pairs(ours: dict, builtin: dict) -> list[tuple[dict, dict]]:
    def key(p):
        return p["name"], p["tokens"], p["requests"], json.dumps(p["signature"], sort_keys=True)
    theirs = {key(p): p for p in builtin["programs"] if "error" not in p}
    return [(p, theirs[key(p)]) for p in ours["programs"]
            if "error" not in p and key(p) in theirs and p["name"] in ("backbone", "compute_logits")]


def vs_builtin(work: Path) -> dict:
    ours_dir = config_directory("qwen3-0.6b", work / "ours")
    builtin_dir = config_directory("qwen3-0.6b", work / "builtin", architecture="Qwen3ForCausalLM")
    ours = compile_one(ours_dir, "v6e-8", TP8, work / "ours.json")
    builtin = compile_one(builtin_dir, "v6e-8", TP8, work / "builtin.json")
    max_seqs = 256  # vLLM's default --max-num-seqs: larger token buckets are prefill chunks
    rows = []
    for p, q in _pairs(ours, builtin):
        kind = "decode" if p["name"] == "compute_logits" or p["tokens"] <= max_seqs else "prefill"
        ops = {op: (p["hlo_ops"].get(op, 0), q["hlo_ops"].get(op, 0))
               for op in sorted(set(p["hlo_ops"]) | set(q["hlo_ops"]))
               if p["hlo_ops"].get(op, 0) != q["hlo_ops"].get(op, 0)}
        rows.append({"program": p["name"], "tokens": p["tokens"], "requests": p["requests"],
                     "kind": kind, "ours_ms": p["estimated_seconds"] * 1e3,
                     "builtin_ms": q["estimated_seconds"] * 1e3,
                     "ours_mb": p["bytes_accessed"] / 1e6, "builtin_mb": q["bytes_accessed"] / 1e6,
                     "ours_gflop": p["flops"] / 1e9, "builtin_gflop": q["flops"] / 1e9,
                     "collectives": (p["all_reduces"] + p["all_gathers"] + p["other_collectives"],
                                     q["all_reduces"] + q["all_gathers"] + q["other_collectives"]),
                     "hlo_ops_differing": ops})
    totals = {kind: (sum(r["ours_ms"] for r in rows if r["kind"] == kind),
                     sum(r["builtin_ms"] for r in rows if r["kind"] == kind))
              for kind in ("decode", "prefill")}
    return {"rows": rows, "ours_over_builtin": {k: round(a / b, 4) for k, (a, b) in totals.items()},
            "compile_seconds": {"ours": ours["seconds"], "builtin": builtin["seconds"]}}


def print_vs_builtin(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title="Qwen3-structural vs tpu-inference's Qwen3, 0.6B shape, TP 8 on v6e-8 "
                        "(compiler estimates)")
    for column in ("program", "tokens", "requests", "ours ms", "built-in ms", "ours MB",
                   "built-in MB", "ours GFLOP", "built-in GFLOP", "collectives", "HLO ops differing"):
        table.add_column(column, justify="left" if column == "program" else "right")
    for r in result["rows"]:
        table.add_row(r["program"], str(r["tokens"] or ""), str(r["requests"] or ""),
                      f"{r['ours_ms']:.4f}", f"{r['builtin_ms']:.4f}", f"{r['ours_mb']:.1f}",
                      f"{r['builtin_mb']:.1f}", f"{r['ours_gflop']:.3f}",
                      f"{r['builtin_gflop']:.3f}", "{} / {}".format(*r["collectives"]),
                      ", ".join(f"{op} {a}/{b}" for op, (a, b) in r["hlo_ops_differing"].items()))
    Console(width=220).print(table)
    print("ours / built-in, summed estimates: " + ", ".join(
        f"{k} {v}" for k, v in result["ours_over_builtin"].items()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="tpu-models bench compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--vs-builtin", action="store_true",
                   help="ours against tpu-inference's Qwen3, program by program")
    p.add_argument("--only", help="comma-separated deployment names (default: all)")
    p.add_argument("--seeds", action="store_true",
                   help="the seeds' deployments and Gemma 3 27B (docs/tpu-path.md's table)")
    p.add_argument("--out", default="bench-compile.json")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tpu-models-bench-compile-"))
    if args.vs_builtin:
        result = vs_builtin(work)
        print_vs_builtin(result)
    else:
        names = (args.only.split(",") if args.only else list(SEEDS) if args.seeds
                 else list(DEPLOYMENTS))
        unknown = [n for n in names if n not in DEPLOYMENTS]
        if unknown:
            sys.exit(f"unknown deployments {unknown}: {', '.join(DEPLOYMENTS)}")
        result = {"rows": deployments(names, work)}
        print_deployments(result["rows"])
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"benchmark": "compile", **({"ours_over_builtin": result["ours_over_builtin"]}
                                                 if args.vs_builtin else
                                                 {"deployments": len(result["rows"])})}))


if __name__ == "__main__":
    main()
