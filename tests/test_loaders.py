"""HF checkpoint reading and the name/shape tables, against transformers' own layout."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from tpu_models.loaders.hf import CheckpointError, HfCheckpoint
from tpu_models import registry
from tests.tiny import check_exactly, make_qwen3, reshard


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen3(tmp_path_factory.mktemp("ckpt"), tied=False)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_qwen3_table_is_transformers_state_dict(tied, bias):
    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                         tie_word_embeddings=tied, attention_bias=bias)
    state = Qwen3ForCausalLM(config).state_dict()
    if tied:
        state.pop("lm_head.weight")  # saved once, under the embedding's name
    expected = {k: tuple(v.shape) for k, v in state.items()}
    assert registry.by_hf_name("Qwen3ForCausalLM").hf_table(config)[0] == expected
    structural, _ = registry.by_hf_name("Qwen3StructuralForCausalLM").hf_table(config)
    assert structural["structural_head.weight"] == (32, 32)
    assert set(structural) - set(expected) == {"structural_head.weight", "structural_head.bias"}


def test_single_and_sharded_list_the_same_tensors(checkpoint, tmp_path):
    import shutil
    single = HfCheckpoint(checkpoint)
    sharded_dir = reshard(shutil.copytree(checkpoint, tmp_path / "sharded"))
    sharded = HfCheckpoint(sharded_dir)
    assert len(sharded.files) == 3
    assert {n: i.shape for n, i in single.tensors.items()} == \
        {n: i.shape for n, i in sharded.tensors.items()}
    check_exactly(sharded, registry.for_checkpoint(checkpoint).hf_table(
        json.loads((checkpoint / "config.json").read_text()))[0])
    streamed = dict(sharded.iter_tensors())
    assert torch.equal(streamed["structural_head.bias"],  # exact: the same bytes read back
                       dict(single.iter_tensors())["structural_head.bias"])


def test_check_names_missing_unexpected_and_misshapen(checkpoint):
    table, _ = registry.for_checkpoint(checkpoint).hf_table(
        json.loads((checkpoint / "config.json").read_text()))
    table.pop("structural_head.bias")  # so the checkpoint has one unexpected tensor
    table["model.norm.weight"] = (65, )
    table["model.layers.9.mlp.up_proj.weight"] = (128, 64)
    with pytest.raises(CheckpointError) as error:
        check_exactly(HfCheckpoint(checkpoint), table)
    message = str(error.value)
    assert "missing tensor model.layers.9.mlp.up_proj.weight (expected shape [128, 64])" in message
    assert "tensor model.norm.weight in model.safetensors has shape [64], expected [65]" in message
    assert "unexpected tensor structural_head.bias in model.safetensors" in message


def test_refuses_pickle_checkpoints(tmp_path):
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only pickle weights \\(pytorch_model.bin\\).*"
                       "safetensors only"):
        HfCheckpoint(tmp_path)


def test_truncated_file_is_named(checkpoint, tmp_path):
    data = (checkpoint / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated: tensor .* needs "
                       "bytes .* but the file ends at"):
        HfCheckpoint(tmp_path)


def test_index_naming_a_missing_shard_is_refused(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="names model-00002-of-00002.safetensors, which does "
                       "not exist"):
        HfCheckpoint(tmp_path)


def test_index_cannot_point_outside_the_checkpoint(tmp_path):
    (tmp_path / "inner").mkdir()
    save_file({"a": torch.zeros(2)}, tmp_path / "outside.safetensors")
    (tmp_path / "inner" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match="lies outside"):
        HfCheckpoint(tmp_path / "inner")


def test_weights_are_cast_to_the_served_dtype_quantized_ones_and_scales_are_not():
    import torch

    from tpu_models.runtime import in_dtype

    tensors = [("w", torch.ones(2, dtype=torch.bfloat16)),
               ("q", torch.ones(2).to(torch.float8_e4m3fn)),  # a pre-quantized weight
               ("q_scale", torch.ones(2, dtype=torch.float32)),  # its scale: not a weight
               ("ids", torch.ones(2, dtype=torch.int32))]
    out = dict(in_dtype(iter(tensors), torch.float32,
                        names={"w", "q", "ids"}))
    assert out["w"].dtype == torch.float32
    assert out["q"].dtype == torch.float8_e4m3fn and out["ids"].dtype == torch.int32
    out = dict(in_dtype(iter(tensors), torch.bfloat16, names={"w", "q", "ids"}))
    assert out["q_scale"].dtype == torch.float32  # scales keep their precision


def test_eagle3_draft_writer_checks_tensors_against_its_config(tmp_path):
    from tpu_models.loaders import eagle3

    target = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 384}
    config = eagle3.draft_config(target, aux_layers=(0, 1, 3), intermediate_size=128)
    shapes = eagle3.shapes(config)
    assert shapes["fc.weight"] == (64, 3 * 64)  # three auxiliary layers of the target
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4 * 16, 2 * 64)  # [embed, hidden]
    tensors = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    tensors["fc.weight"] = np.zeros((64, 64), np.float32)
    with pytest.raises(ValueError, match=r"fc\.weight: shape \(64, 64\), expected \(64, 192\)"):
        eagle3.write_draft(tmp_path / "draft", config, tensors)
    assert not (tmp_path / "draft").exists()
    del tensors["fc.weight"]
    with pytest.raises(ValueError, match=r"missing \['fc\.weight'\]"):
        eagle3.write_draft(tmp_path / "draft", config, tensors)
