"""Export throughput and peak memory: MaxText (scanned) -> HF safetensors.

Writes a random-weight MaxText training-state checkpoint of about `--size-mb`
megabytes (a Qwen3-style decoder, scanned layers), then times
`tpu-models export maxtext` on it in a fresh process and reads that process's
peak RSS. The exporter reads one (stacked) tensor at a time, so its peak should
track the largest tensor plus the Python/JAX baseline and one shard's worth of
queued tensors, not the checkpoint size.

    python -m tpu_models.benchmarks.export_speed [--size-mb 600] [--out export-speed.json]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BASELINE = "import numpy, orbax.checkpoint, safetensors, tpu_models.loaders.export, tpu_models.loaders.maxtext"


def config_for(size_mb: float) -> dict:
    """A Qwen3-structural config of roughly size_mb megabytes in fp32."""
    hidden, mlp, heads, kv_heads, head_dim, vocab = 1024, 3072, 16, 8, 64, 32000
    per_layer = hidden * (heads * head_dim * 2 + kv_heads * head_dim * 2) + 3 * hidden * mlp
    fixed = 2 * vocab * hidden + hidden * hidden
    layers = max(1, round((size_mb * 2**20 / 4 - fixed) / per_layer))
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": mlp,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "tie_word_embeddings": False, "architectures": ["Qwen3StructuralForCausalLM"]}


def write_checkpoint(directory: Path, config: dict) -> tuple[int, int]:
    """Random weights in MaxText's scanned layout; returns (total bytes, largest leaf bytes)."""
    import orbax.checkpoint as ocp

    from tpu_models.benchmarks.checkpoints import hf_to_maxtext
    from tpu_models import registry

    arch = registry.by_export_name("qwen3-structural")
    rng = np.random.default_rng(0)
    hf = {name: rng.standard_normal(shape, dtype=np.float32) * 0.02
          for name, shape in arch.hf_table(config)[0].items()}
    tree = hf_to_maxtext(hf, arch.maxtext, config, scanned=True)
    del hf
    leaves = []

    def walk(node):
        for value in node.values():
            walk(value) if isinstance(value, dict) else leaves.append(value.nbytes)

    walk(tree)
    ocp.PyTreeCheckpointer().save((directory / "checkpoints" / "0" / "items").absolute(),
                                  {"params": {"params": tree}})
    return sum(leaves), max(leaves)


def run_measured(command: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of a child process, sampled every 10 ms.

    (getrusage's children maxrss would count this large parent's pages, which a
    forked child shares until it execs.)"""
    import psutil

    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    watched, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    seconds = time.perf_counter() - start
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)
    return seconds, peak


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=600)
    parser.add_argument("--out", default="export-speed.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="export-bench-") as tmp:
        tmp = Path(tmp)
        config = config_for(args.size_mb)
        total, largest = write_checkpoint(tmp / "run", config)
        _, baseline_rss = run_measured([sys.executable, "-c", BASELINE])
        seconds, peak_rss = run_measured([
            sys.executable, "-m", "tpu_models.server.cli", "export", "maxtext", str(tmp / "run"),
            "--model", "qwen3-structural", "--out", str(tmp / "hf"),
            "--max-shard-size", str(256 * 2**20)])
        written = sum(p.stat().st_size for p in (tmp / "hf").glob("*.safetensors"))
    result = {
        "benchmark": "export_maxtext", "layers": config["num_hidden_layers"],
        "checkpoint_mb": total / 2**20, "written_mb": written / 2**20,
        "largest_tensor_mb": largest / 2**20, "seconds": seconds,
        "throughput_mb_s": written / 2**20 / seconds, "peak_rss_mb": peak_rss / 2**20,
        "baseline_rss_mb": baseline_rss / 2**20,
        "peak_over_baseline_mb": (peak_rss - baseline_rss) / 2**20,
    }
    from rich.console import Console
    from rich.table import Table
    table = Table(title="MaxText (scanned) -> HF export")
    for key in ("checkpoint_mb", "largest_tensor_mb", "seconds", "throughput_mb_s",
                "peak_rss_mb", "baseline_rss_mb", "peak_over_baseline_mb"):
        table.add_row(key, f"{result[key]:.1f}")
    Console(width=120).print(table)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
