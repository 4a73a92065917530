"""A bad checkpoint fails at start-up, with an error naming the tensor or field."""

import json

import pytest
from safetensors.torch import load_file, save_file

from loaders.hf import CheckpointError
from benchmarks.harness import Stepper
from server.process import Server
from tests.tiny import make_qwen3


def edit_tensors(directory, edit):
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.mark.e2e
def test_missing_tensor_stops_vllm_serve(tmp_path):
    checkpoint = edit_tensors(make_qwen3(tmp_path / "m"),
                              lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    server = Server(checkpoint, "--dtype", "float32", "--max-model-len", "256",
                    log=tmp_path / "serve.log")
    assert server.wait_exit() != 0
    assert "missing tensor model.layers.1.mlp.down_proj.weight (expected shape [64, 128])" \
        in server.output()


@pytest.mark.e2e
def test_unknown_architecture_stops_vllm_serve(tmp_path):
    checkpoint = make_qwen3(tmp_path / "m")
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["Qwen3StructurallFoCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    server = Server(checkpoint, "--max-model-len", "256", log=tmp_path / "serve.log")
    assert server.wait_exit() != 0
    assert "Qwen3StructurallFoCausalLM" in server.output()
    assert "not supported" in server.output()


def test_wrong_shape_is_refused_before_loading(tmp_path):
    def widen(tensors):
        tensors["structural_head.bias"] = tensors["structural_head.bias"].repeat(2)

    checkpoint = edit_tensors(make_qwen3(tmp_path / "m"), widen)
    with pytest.raises(CheckpointError, match="tensor structural_head.bias in model.safetensors "
                       "has shape \\[128\\], expected \\[64\\]"):
        Stepper(checkpoint)
