"""A bad checkpoint fails at start-up, with an error naming the tensor or field."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpu_models.loaders.hf import CheckpointError, HfCheckpoint, count_nonfinite
from tpu_models.loaders.tables import check_checkpoint, read_config
from tpu_models import registry
from tpu_models.harness.stepper import Stepper
from tpu_models.harness.serve_process import Server, launched
from tpu_models.server.serve import build_command
from tests.tiny import make_qwen3


def edit_tensors(directory, edit):
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.mark.e2e
def test_bad_checkpoints_stop_the_server_naming_the_fault(qwen3, tmp_path):
    """Served with `tpu-models serve` (vLLM's own loading for the first two), each
    exits at start-up with the fault named. The three start at once: a start-up
    is mostly vLLM's single-threaded import, so they share the host's cores."""
    missing = edit_tensors(make_qwen3(tmp_path / "missing"),
                           lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    unknown = make_qwen3(tmp_path / "unknown")
    config = json.loads((unknown / "config.json").read_text())
    config["architectures"] = ["Qwen3StructurallFoCausalLM"]
    (unknown / "config.json").write_text(json.dumps(config))
    nan = edit_tensors(copy(qwen3, tmp_path / "nan"),
                       lambda t: t["structural_head.bias"].__setitem__(7, float("nan")))
    cases = {  # name: (checkpoint, options, what the log must say)
        "missing-tensor": (missing, ["--dtype", "float32"],
                           ["missing tensor model.layers.1.mlp.down_proj.weight "
                            "(expected shape [64, 128])"]),
        "unknown-architecture": (unknown, [], ["Qwen3StructurallFoCausalLM", "not supported"]),
        "check-weights": (nan, ["--check-weights", "--dtype", "float32"],
                          ["tensor structural_head.bias [64] holds 1 NaN value (of 64)"]),
    }
    servers = {name: Server(checkpoint, *options, "--max-model-len", "256",
                            log=tmp_path / f"{name}.log")
               for name, (checkpoint, options, _) in cases.items()}
    with launched(servers):
        codes = {name: server.wait_exit() for name, server in servers.items()}
    for name, (_, _, messages) in cases.items():
        assert codes[name] != 0, name
        for message in messages:
            assert message in servers[name].output(), name


def test_wrong_shape_is_refused_before_loading(tmp_path):
    def widen(tensors):
        tensors["structural_head.bias"] = tensors["structural_head.bias"].repeat(2)

    checkpoint = edit_tensors(make_qwen3(tmp_path / "m"), widen)
    with pytest.raises(CheckpointError, match="tensor structural_head.bias in model.safetensors "
                       "has shape \\[128\\], expected \\[64\\]"):
        Stepper(checkpoint)


# --- Checkpoint-level bad input: each refused at start-up, naming the file,
# tensor or field. Most cases run at the function level (HfCheckpoint and the
# model's real load path through tpu-inference's get_model, via Stepper); one
# more goes through `tpu-models serve`.

def copy(checkpoint, tmp_path):
    return Path(shutil.copytree(checkpoint, tmp_path / "m"))


def rewrite_header(file: Path, edit) -> None:
    """Rewrites a safetensors header in place, keeping the data bytes."""
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    file.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length:])


def last_tensor(header: dict) -> str:
    return max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])


def grow_last(header):  # offsets past the end of the file, consistent with the shape
    entry = header[last_tensor(header)]
    begin, end = entry["data_offsets"]
    entry["shape"][0] *= 2
    entry["data_offsets"] = [begin, begin + 2 * (end - begin)]


def overlap(header):
    entry = header["b.bias"]
    size = entry["data_offsets"][1] - entry["data_offsets"][0]
    entry["data_offsets"] = [0, size]


def cut(n):
    return lambda f: f.write_bytes(f.read_bytes()[:n])


DAMAGES = {
    "data cut short": (lambda f: f.write_bytes(f.read_bytes()[:-10]),
                       r"x.safetensors: truncated: tensor c.weight needs bytes \d+..\d+ but the "
                       r"file ends at \d+ \(a complete file has \d+ bytes\)"),
    "header cut short": (cut(40), r"x.safetensors: not a safetensors file, or truncated: its "
                                  r"first 8 bytes announce a \d+-byte header, the file has 40 bytes"),
    "empty file": (cut(0), r"x.safetensors: truncated: 0 bytes, too short for a safetensors header"),
    "garbage header": (lambda f: f.write_bytes(f.read_bytes()[:8] + b"\xff" * 20 +
                                               f.read_bytes()[28:]),
                       r"x.safetensors: corrupted safetensors header: not valid JSON"),
    "offsets past the end": (lambda f: rewrite_header(f, grow_last),
                             r"x.safetensors: truncated: tensor c.weight needs bytes"),
    "overlapping offsets": (lambda f: rewrite_header(f, overlap),
                            r"x.safetensors: corrupted safetensors header: tensor \S+ starts at "
                            r"data byte \d+, expected \d+ \(overlapping or a gap\)"),
    "unknown dtype": (lambda f: rewrite_header(f, lambda h: h["b.bias"].update(dtype="F99")),
                      r"x.safetensors: corrupted safetensors header: tensor b.bias has unknown "
                      r"dtype 'F99'"),
    "shape and offsets disagree": (
        lambda f: rewrite_header(f, lambda h: h["a.weight"].update(shape=[4, 5])),
        r"x.safetensors: corrupted safetensors header: tensor a.weight F32 \[4, 5\] needs 80 "
        r"bytes but its data_offsets \[0, 64\] span 64"),
    "trailing bytes": (lambda f: f.write_bytes(f.read_bytes() + b"\0" * 16),
                       r"x.safetensors: corrupted: 16 bytes after the last tensor"),
    "pickle named .safetensors": (
        lambda f: torch.save({"w": torch.zeros(2)}, f),
        r"x.safetensors: a pickle \(torch.save\) file, not safetensors; tpu-models loads "
        r"safetensors only"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_truncated_and_corrupted_files_are_refused_from_the_header(damage, tmp_path):
    file = tmp_path / "x.safetensors"
    save_file({"a.weight": torch.zeros(4, 4), "b.bias": torch.ones(3),
               "c.weight": torch.ones(8, 2)}, file)
    HfCheckpoint(tmp_path)  # intact
    damage_fn, message = DAMAGES[damage]
    damage_fn(file)
    with pytest.raises(CheckpointError, match=message):
        HfCheckpoint(tmp_path)


def test_index_naming_pickle_shards_is_refused(tmp_path):
    torch.save({"a": torch.zeros(2)}, tmp_path / "pytorch_model-00001-of-00001.bin")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "pytorch_model-00001-of-00001.bin"}}))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: names "
                       "pytorch_model-00001-of-00001.bin, a pickle file; tpu-models loads "
                       "safetensors only"):
        HfCheckpoint(tmp_path)


def test_pickle_checkpoint_stops_the_model_load(qwen3, tmp_path):
    checkpoint = copy(qwen3, tmp_path)
    torch.save(load_file(checkpoint / "model.safetensors"), checkpoint / "pytorch_model.bin")
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="only pickle weights \\(pytorch_model.bin\\); "
                       "tpu-models loads safetensors only"):
        Stepper(checkpoint)


def test_nan_and_inf_weights_are_refused_when_asked(qwen3, tmp_path):
    def poison(tensors):
        tensors["model.layers.1.mlp.down_proj.weight"][3, :5] = float("nan")
        tensors["model.layers.1.mlp.down_proj.weight"][4, 0] = float("inf")
        tensors["model.norm.weight"][0] = float("-inf")  # later in the file

    checkpoint = edit_tensors(copy(qwen3, tmp_path), poison)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{checkpoint / 'model.safetensors'}: tensor model.layers.1.mlp.down_proj.weight "
            "[64, 128] holds 5 NaN and 1 infinite values (of 8192)")):
        Stepper(checkpoint, additional_config={"check_weights": True})
    Stepper(checkpoint)  # opt-in: without the check the same checkpoint loads


def test_nonfinite_counts_every_float_dtype():
    values = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0])
    assert count_nonfinite(values) == (1, 2)
    assert count_nonfinite(values.to(torch.bfloat16)) == (1, 2)
    assert count_nonfinite(torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn)) == (1, 0)
    assert count_nonfinite(values, chunk=2) == (1, 2)
    assert count_nonfinite(torch.arange(5)) == (0, 0)


def test_serve_check_weights_flag_maps_onto_additional_config():
    command, _ = build_command(["./m", "--check-weights", "--lora", "/a",
                                "--additional-config", '{"x": 1}'], {})
    config = json.loads(command[command.index("--additional-config") + 1])
    assert config == {"x": 1, "merge_lora": "/a", "check_weights": True}


def write_config(checkpoint: Path, **changes) -> dict:
    config = json.loads((checkpoint / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (checkpoint / "config.json").write_text(json.dumps(config))
    return config


def test_config_disagreeing_with_the_tensors_names_field_and_tensor(qwen3, tmp_path):
    checkpoint = copy(qwen3, tmp_path)
    write_config(checkpoint, vocab_size=400)
    with pytest.raises(CheckpointError) as error:
        Stepper(checkpoint)
    assert str(error.value).startswith(
        f"{checkpoint / 'config.json'} disagrees with the tensors: vocab_size=400 but "
        "model.embed_tokens.weight in model.safetensors has 384 rows. Hence: tensor "
        "model.embed_tokens.weight in model.safetensors has shape [384, 64], expected [400, 64]")


def test_config_missing_a_size_field_is_refused(qwen3, tmp_path):
    checkpoint = copy(qwen3, tmp_path)
    write_config(checkpoint, intermediate_size=None)  # transformers would silently take 22016
    with pytest.raises(CheckpointError, match=re.escape(
            f"{checkpoint / 'config.json'}: no 'intermediate_size' field")):
        Stepper(checkpoint)


@pytest.mark.parametrize("changes,message", [
    ({"hidden_size": "64"}, "hidden_size=\"64\" is not a positive integer"),
    ({"num_attention_heads": 0, "intermediate_size": None},
     "no 'intermediate_size' field; num_attention_heads=0 is not a positive integer"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"head_dim": 32}, "config.json disagrees with the tensors: head_dim=32 but "
                       "model.layers.0.self_attn.q_norm.weight in model.safetensors has 16 entries"),
    ({"num_attention_heads": 8, "num_key_value_heads": 4},
     "num_attention_heads=8 but model.layers.0.self_attn.q_proj.weight in model.safetensors has "
     "64 rows (4 heads of head_dim 16); num_key_value_heads=4 but "
     "model.layers.0.self_attn.k_proj.weight in model.safetensors has 32 rows (2 heads"),
    ({"num_hidden_layers": 3}, "num_hidden_layers=3 but the checkpoint holds model.layers.0 .. "
                               "model.layers.1. Hence: missing tensor model.layers.2."),
    ({"intermediate_size": 96, "hidden_size": 32},
     "hidden_size=32 but model.embed_tokens.weight in model.safetensors has 64 columns; "
     "intermediate_size=96 but model.layers.0.mlp.gate_proj.weight"),
])
def test_config_fields_are_named(qwen3, tmp_path, changes, message):
    """The same checks the load path runs, as the exporters run them on a base checkpoint."""
    checkpoint = copy(qwen3, tmp_path)
    write_config(checkpoint, **changes)
    with pytest.raises(CheckpointError, match=re.escape(message)) as error:
        config, _ = read_config(checkpoint)
        table, optional = registry.for_config(config).hf_table(config)
        check_checkpoint(HfCheckpoint(checkpoint), config, table, optional=optional)
    assert "config.json" in str(error.value)


def test_tokenizer_larger_than_the_embedding_is_refused(qwen3, tmp_path):
    from transformers import AutoTokenizer
    checkpoint = copy(qwen3, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(60)])
    tokenizer.save_pretrained(checkpoint)
    size = len(tokenizer)
    assert size > 384
    with pytest.raises(CheckpointError, match=re.escape(
            f"tokenizer {checkpoint / 'tokenizer.json'} has {size} tokens (ids 0..{size - 1}) but "
            f"the model's embedding has 384 rows (config.json vocab_size=384): ids "
            f"384..{size - 1} would have no embedding")):
        Stepper(checkpoint)
