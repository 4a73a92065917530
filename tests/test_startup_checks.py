"""Start-up mistakes `tpu-models serve` names in one line, in seconds, before vLLM starts."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.tiny import make_lora


def serve(*args) -> tuple[int, str, float]:
    """(exit status, last line of stderr, seconds) of `tpu-models serve ARGS`."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tpu_models.server.cli", "serve", *args],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    lines = done.stderr.strip().splitlines() or [""]
    return done.returncode, lines[-1], time.monotonic() - began


def test_a_model_path_that_does_not_exist(tmp_path):
    status, last, seconds = serve(str(tmp_path / "my-model"))
    assert status != 0 and seconds < 60
    assert last == (f"tpu-models serve: {tmp_path / 'my-model'}: no such directory (MODEL is a "
                    "checkpoint directory, a gs:// or s3:// prefix, or a Hugging Face "
                    "repository id)")


def test_plain_vllm_serve_names_a_missing_model_directory(tmp_path):
    # The plugin's check, in vLLM's own CLI (offline, as the tests run): its last line
    # names the directory, where it named huggingface_hub's repository ids.
    env = {**os.environ, "MODEL_IMPL_TYPE": "flax_nnx", "JAX_PLATFORMS": "cpu"}
    model = tmp_path / "my-model"
    done = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model)],
                          capture_output=True, text=True, timeout=120, env=env)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    assert done.returncode != 0 and last.startswith(f"ValueError: {model}: no such directory"), last


def test_a_config_only_directory(qwen3, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3 / name, config_only / name)
    status, last, _ = serve(str(config_only))
    assert status != 0
    assert last.startswith(f"tpu-models serve: {config_only}: no *.safetensors weights. ")
    assert "--load-format dummy" in last and "tpu-models compile" in last


def test_a_lora_directory_that_does_not_exist(qwen3, tmp_path):
    status, last, _ = serve(str(qwen3), "--lora", str(tmp_path / "adapter"))
    assert status != 0
    assert last == f"tpu-models serve: --lora: {tmp_path / 'adapter'}: no such directory"


def test_an_adapter_above_max_lora_rank_is_refused_before_anything_compiles(qwen3, tmp_path):
    adapter = make_lora(qwen3, tmp_path / "wide", r=32)
    status, last, seconds = serve(str(qwen3), "--enable-lora", "--max-lora-rank", "16",
                                  "--lora-modules", f"wide={adapter}")
    assert status != 0 and seconds < 60  # the engine refused it after 43 s of compiling
    assert last == (f"tpu-models serve: --lora-modules: LoRA adapter 'wide': {adapter}: rank "
                    "r=32 is above --max-lora-rank 16 (pass --max-lora-rank 32)")
    # vLLM's JSON form of an entry names the same adapter.
    entry = json.dumps({"name": "wide", "path": str(adapter)})
    status, last, _ = serve(str(qwen3), "--enable-lora", "--lora-modules", entry)
    assert status != 0 and "LoRA adapter 'wide'" in last and "r=32" in last


def test_an_adapter_for_another_model_is_refused_against_the_base_checkpoint(qwen3, gemma3,
                                                                              tmp_path):
    adapter = make_lora(gemma3, tmp_path / "for-gemma3", r=4)
    status, last, seconds = serve(str(qwen3), "--lora", str(adapter))
    assert status != 0 and seconds < 60
    assert last.startswith(f"tpu-models serve: --lora: LoRA adapter {adapter}: ")
    assert "adapter trained for another model?" in last


def test_local_hosts_that_do_not_split_the_devices():
    status, last, _ = serve("--tensor-parallel-size", "3", "--local-hosts", "2")
    assert status != 0
    assert last == ("tpu-models serve: --tensor-parallel-size 3 does not split evenly over "
                    "--local-hosts 2: each host holds the same number of devices")


def test_local_hosts_choose_the_executor_or_the_replicas():
    from tpu_models.server.serve import build_command

    command, env = build_command(["-tp", "4", "--local-hosts", "2"], {})
    assert env["TPU_MULTIHOST_BACKEND"] == "ray" and env["TPU_MODELS_HOST_DEVICES"] == "2"
    command, env = build_command(["-tp", "2", "--data-parallel-size", "4",
                                  "--data-parallel-backend", "ray", "--local-hosts", "2"], {})
    # vLLM's replicas, two a host: no engine across hosts
    assert "TPU_MULTIHOST_BACKEND" not in env and env["TPU_MODELS_HOST_DEVICES"] == "4"
    assert command[command.index("--data-parallel-size-local") + 1] == "2"
