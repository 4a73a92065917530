"""What a newcomer types first: ./dev's help, tpu-models' help, and serve's dry run, run
as printed."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


# What serve sets, left unset here as in a new user's shell.
SET_BY_SERVE = ("MODEL_IMPL_TYPE", "JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE", "TPU_NAME",
                "TPU_WORKER_ID")


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpu_models.server.cli", *args],
                          capture_output=True, text=True, timeout=300, env=users_env())


def users_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in SET_BY_SERVE}


def test_dev_says_its_commands():
    for flag in ("--help", "-h"):
        done = subprocess.run([str(ROOT / "dev"), flag], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert "serve [MODEL]" in done.stdout and "test [pytest args]" in done.stdout


def test_tpu_models_help_lists_every_bench_subcommand():
    import argparse

    from tpu_models.benchmarks import dispatch
    sub = next(a for a in dispatch.parser()._actions if isinstance(a, argparse._SubParsersAction))
    names = set(sub.choices) | set(dispatch.OWN_OPTIONS)
    listed = cli("--help").stdout.split("bench ", 1)[1]
    assert {n for n in names if f"\n             {n} " not in listed} == set(), listed


def test_serve_help_says_its_defaults_and_where_vllms_options_are():
    text = " ".join(cli("serve", "--help").stdout.split())
    for default in ("--host 127.0.0.1", "--dtype float32", "--max-num-batched-tokens 256",
                    "--max-num-seqs 64", "20% of the host's memory", "vllm serve --help=all"):
        assert default in text, default


def test_serve_dry_run_prints_shell_lines_that_run_it():
    # A quantization preset puts JSON with quotes and backslashes on the command line.
    done = cli("serve", "--dry-run", "--quant", "int8-weight-only", "--port", "8123")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    exports, command = lines[:-1], lines[-1]
    assert exports and all(line.startswith("export ") for line in exports)
    assert {"export MODEL_IMPL_TYPE=flax_nnx", "export JAX_PLATFORMS=cpu",
            "export TPU_WORKER_ID=0"} <= set(exports)
    words = shlex.split(command)
    config = json.loads(words[words.index("--additional-config") + 1])
    assert config["quantization"]["qwix"]["rules"]
    # Run as printed (vLLM's own --help, so that no server starts): the environment
    # lines and the quoted command are what a shell accepts.
    script = "\n".join([*exports, command + " --help"])
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300,
                         env=users_env())
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: vllm serve")
