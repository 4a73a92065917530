"""MaxText checkpoints -> HF: the exported model computes what MaxText computed.

Fixtures in tests/fixtures/maxtext come from MaxText 0.2.5 itself (2 training
steps on CPU), with the logits of MaxText's own forward pass and an
independent numpy conversion (hf_reference.safetensors): see its README.md.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file, save_file

from tpu_models.loaders.exporter.convert import maxtext
from tpu_models.loaders.hf import CheckpointError, HfCheckpoint
from tpu_models.loaders.maxtext import to_maxtext_tree
from tpu_models.registry import by_export_name as arch
from tpu_models.harness.stepper import Stepper
from tests.tiny import Reference, make_gemma3, make_qwen3, make_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "maxtext"
TINY_GEMMA = {"sliding_window": 4}  # the fixtures' sliding_window_size (MaxText's default: 1024)


def hf_tensors(directory: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def reference_dir(fixture: str, exported: Path, tmp_path: Path, extra=None) -> Path:
    """The independent conversion as an HF checkpoint, with our exported config."""
    directory = tmp_path / f"{fixture}-reference"
    directory.mkdir()
    shutil.copy(exported / "config.json", directory)
    save_file({**load_file(FIXTURES / fixture / "hf_reference.safetensors"), **(extra or {})},
              directory / "model.safetensors")
    return directory


def maxtext_logits(fixture):
    tokens = np.load(FIXTURES / fixture / "logits_tokens.npy").reshape(-1).tolist()
    return tokens, np.load(FIXTURES / fixture / "logits.npy")[0]


@pytest.mark.parametrize("fixture,model,overrides,tied", [
    ("qwen3_untied_scanned", "qwen3", {}, False),
    ("qwen3_unscanned", "qwen3", {}, True),
    ("gemma3_14l_scanned", "gemma3", TINY_GEMMA, True),  # 2 blocks of 6 + 2 remainder layers
])
def test_real_maxtext_checkpoints(fixture, model, overrides, tied, tmp_path):
    out = maxtext(FIXTURES / fixture, arch(model), tmp_path / "out", overrides=overrides)
    exported = hf_tensors(out)
    independent = load_file(FIXTURES / fixture / "hf_reference.safetensors")
    assert exported.keys() == independent.keys()
    # Both numpy, IEEE-rounded on every host; copies and Gemma's norms (s - 1, one rounding)
    # agree exactly. Gemma's embedding: ours rounds x/sqrt(D) once from float64 (<= u), the
    # reference rounds sqrt(D), then x/that (<= 2u): 3u = 1.8e-7 < 2e-7 relative.
    for name, array in independent.items():
        np.testing.assert_allclose(exported[name], array, rtol=2e-7, atol=0, err_msg=name)

    tokens, want = maxtext_logits(fixture)
    if model == "gemma3":
        got = Stepper(out).step({"a": tokens})["a"][:, :want.shape[-1]]
    else:  # head_dim 16: tpu-inference's built-in Qwen3 pads it to 128 and cannot load it
        got = Reference(out).logits(tokens)
    # fp32 logits vs transformers fp32 on weights equal to 2e-7: reduction order differs,
    # 1e-4 absolute on O(1)-O(10) logits.
    np.testing.assert_allclose(got, Reference(reference_dir(fixture, out, tmp_path)).logits(tokens),
                               atol=1e-4, rtol=0)
    if tied:
        # MaxText's tied head multiplies by the embedding table rounded to bfloat16
        # (attend_on_embedding; 8 significant bits, each entry off by <= 2^-8 relative), so a
        # logit is off by <= 2^-8 * sum_i |h_i E_vi|, h the head's input (the final norm's
        # output), plus the 1e-4 of fp32 (measured: 0.3-0.4 of this bound).
        import torch
        with torch.no_grad():
            h = Reference(out).model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
        table = np.abs(exported["model.embed_tokens.weight"]).astype(np.float64)
        bound = 2.0**-8 * (np.abs(h.numpy()).astype(np.float64) @ table.T) + 1e-4
        assert (np.abs(got - want) <= bound).all(), (np.abs(got - want) / bound).max()
        # top-1 margins of MaxText's logits are >= 0.065, 10x the bf16 effect: decisive
        assert (got.argmax(-1) == want.argmax(-1)).all()
    else:
        # fp32 MaxText (XLA, fixture) vs ours: reduction order differs, 1e-4 on O(1) logits
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_parameter_only_layout_is_the_same_model_in_bfloat16(tmp_path):
    """generate_param_only_checkpoint's NNX layout ({decoder,...}/.../value, bf16)."""
    full = hf_tensors(maxtext(FIXTURES / "qwen3_unscanned", arch("qwen3"), tmp_path / "full"))
    only = maxtext(FIXTURES / "qwen3_unscanned_paramonly", arch("qwen3"), tmp_path / "only")
    params = hf_tensors(only)
    assert json.loads((only / "config.json").read_text())["dtype"] == "bfloat16"
    assert params.keys() == full.keys()
    for name, array in params.items():
        assert array.dtype == ml_dtypes.bfloat16
        # exact: both are the fp32 weights rounded to nearest-even bf16 (one IEEE rounding)
        np.testing.assert_array_equal(array, full[name].astype(ml_dtypes.bfloat16), err_msg=name)


def save_maxtext(directory: Path, tree: dict) -> Path:
    """MaxText's training-state layout: <run>/checkpoints/<step>/items with the Linen
    parameters under params/params (maxtext train.py saves TrainState via orbax)."""
    ocp.PyTreeCheckpointer().save((directory / "checkpoints" / "0" / "items").absolute(),
                                  {"params": {"params": tree}})
    return directory


def read_maxtext_params(fixture: str) -> dict:
    item = (FIXTURES / fixture / "checkpoints" / "1" / "items").absolute()
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(item).item_metadata.tree
    args = {"params": {"params": _restore_args(tree["params"]["params"])}}
    return checkpointer.restore(item, args=ocp.args.PyTreeRestore(
        item={"params": tree["params"]}, restore_args=args, partial_restore=True))["params"]["params"]


def _restore_args(node):
    if isinstance(node, dict):
        return {k: _restore_args(v) for k, v in node.items()}
    return ocp.RestoreArgs(restore_type=np.ndarray)


def test_structural_head_from_a_maxtext_tree(tmp_path):
    """The real Qwen3 run plus a structural head where our fork puts it (decoder/
    structural_head, a DenseGeneral: kernel [in, out], bias [out])."""
    rng = np.random.default_rng(0)
    params = read_maxtext_params("qwen3_unscanned")
    kernel = (rng.normal(size=(64, 64)) * 0.15).astype(np.float32)
    bias = (rng.normal(size=64) * 0.1).astype(np.float32)
    params["decoder"]["structural_head"] = {"kernel": kernel, "bias": bias}
    checkpoint = save_maxtext(tmp_path / "run", params)
    out = maxtext(checkpoint, arch("qwen3-structural"), tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["architectures"] == \
        ["Qwen3StructuralForCausalLM"]
    reference = Reference(reference_dir("qwen3_unscanned", out, tmp_path, extra={
        "structural_head.weight": kernel.T.copy(), "structural_head.bias": bias}))
    tokens, _ = maxtext_logits("qwen3_unscanned")
    got = Stepper(out).step({"a": tokens})["a"][:, :512]
    # fp32 logits vs transformers fp32: reduction order differs, 1e-4 absolute on O(1) logits
    np.testing.assert_allclose(got, reference.logits(tokens), atol=1e-4, rtol=0)
    with pytest.raises(CheckpointError, match="no .../structural_head/kernel anywhere"):
        maxtext(FIXTURES / "qwen3_unscanned", arch("qwen3-structural"), tmp_path / "none")


@pytest.mark.parametrize("model", ["qwen3-structural", "gemma3"])
def test_round_trip_hf_maxtext_hf(model, tmp_path):
    """HF -> MaxText layout (scanned and unscanned) -> export -> HF."""
    if model == "gemma3":  # 8 layers: one scanned block of 6, two remainder layers
        source = make_gemma3(tmp_path / "hf", num_layers=8, sliding_window=16)
        overrides = {"sliding_window": 16, "query_pre_attn_scalar": 24,
                     "rope_parameters": json.loads((source / "config.json").read_text())[
                         "rope_parameters"]}
    else:
        source = make_qwen3(tmp_path / "hf", num_layers=3)
        overrides = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    config = json.loads((source / "config.json").read_text())
    original = hf_tensors(source)
    exports = {}
    for scanned in (True, False):
        tree = to_maxtext_tree(original, arch(model).maxtext, config, scanned=scanned)
        run = save_maxtext(tmp_path / f"run-{scanned}", tree)
        exports[scanned] = maxtext(run, arch(model), tmp_path / f"out-{scanned}",
                                   overrides=overrides, tokenizer=source)
    scanned, unscanned = hf_tensors(exports[True]), hf_tensors(exports[False])
    assert scanned.keys() == unscanned.keys() == original.keys()
    for name in original:
        # exact: stacking layers (scan) and copies move values, no arithmetic
        np.testing.assert_array_equal(scanned[name], unscanned[name], err_msg=name)
        if model == "qwen3-structural" or not name.endswith(("norm.weight", "embed_tokens.weight")):
            np.testing.assert_array_equal(scanned[name], original[name], err_msg=name)
        else:  # Gemma norms (+1) and embedding (*sqrt(D)): one fp32 rounding in MaxText's store
            # and one on the way back (float64 transforms, IEEE on every host): each <= u of its
            # value, together <= 2u (1 + |x|) = 1.2e-7 (1 + |x|) < 2.5e-7 (1 + |x|)
            np.testing.assert_allclose(scanned[name], original[name], atol=2.5e-7, rtol=2.5e-7)
    ids = np.random.default_rng(0).integers(0, 384, 40).tolist()
    # fp32 logits vs transformers fp32: reduction order differs, 1e-4 absolute on O(1) logits
    np.testing.assert_allclose(Stepper(exports[True]).step({"a": ids})["a"][:, :384],
                               Reference(source).logits(ids), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("small")
    source = make_qwen3(directory / "hf", num_layers=2)
    config = json.loads((source / "config.json").read_text())
    return source, config, hf_tensors(source)


def test_bad_trees_are_refused_naming_the_tensor(small_run, tmp_path):
    source, config, original = small_run
    tree = to_maxtext_tree(original, arch("qwen3-structural").maxtext, config, scanned=False)
    del tree["decoder"]["layers_1"]["mlp"]["wo"]
    tree["decoder"]["layers_0"]["extra"] = {"kernel": np.zeros((2, 2), np.float32)}
    with pytest.raises(CheckpointError) as error:
        maxtext(save_maxtext(tmp_path / "bad", tree), arch("qwen3-structural"), tmp_path / "out")
    assert "missing tensor decoder/layers_1/mlp/wo/kernel (for model.layers.1.mlp.down_proj" \
        in str(error.value)
    assert "unexpected tensors" in str(error.value) and "decoder/layers_0/extra/kernel" \
        in str(error.value)
    assert not (tmp_path / "out").exists()


def test_scanned_given_as_unscanned_and_wrong_sizes(small_run, tmp_path):
    source, config, original = small_run
    mapping = arch("qwen3-structural").maxtext
    run = save_maxtext(tmp_path / "run", to_maxtext_tree(original, mapping, config, scanned=True))
    with pytest.raises(CheckpointError, match="is scanned .* not unscanned"):
        maxtext(run, arch("qwen3-structural"), tmp_path / "out", scan="unscanned")
    with pytest.raises(CheckpointError, match="num_hidden_layers=3 but the checkpoint holds "
                       "scanned, 2 layers on axis 1"):
        maxtext(run, arch("qwen3-structural"), tmp_path / "out", scan="scanned",
                overrides={"num_hidden_layers": 3})
    with pytest.raises(CheckpointError, match="tensor token_embedder/embedding \\[384, 64\\] gives "
                       "model.embed_tokens.weight of shape \\[384, 64\\], config.json implies "
                       "\\[400, 64\\]"):
        maxtext(run, arch("qwen3-structural"), tmp_path / "out", overrides={"vocab_size": 400})
    assert not (tmp_path / "out").exists()


def test_truncated_checkpoint_and_existing_output(small_run, tmp_path):
    source, config, original = small_run
    mapping = arch("qwen3-structural").maxtext
    run = save_maxtext(tmp_path / "run", to_maxtext_tree(original, mapping, config, scanned=False))
    for data in (run / "checkpoints" / "0" / "items").rglob("d/*"):
        data.write_bytes(data.read_bytes()[: len(data.read_bytes()) // 2])
    with pytest.raises(CheckpointError, match="cannot read"):
        maxtext(run, arch("qwen3-structural"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="already exists \\(pass --overwrite"):
        maxtext(FIXTURES / "qwen3_unscanned", arch("qwen3"), tmp_path / "taken")


def test_cli_writes_shards_index_tokenizer_and_inspect_reads_them(tmp_path):
    tokenizer = tmp_path / "tok"
    make_tokenizer(tokenizer, 512)
    run = lambda *a: subprocess.run([sys.executable, "-m", "tpu_models.server.cli", *a], capture_output=True,
                                    text=True, timeout=300)
    result = run("export", "maxtext", str(FIXTURES / "gemma3_14l_scanned"), "--model", "gemma3",
                 "--out", str(tmp_path / "out"), "--tokenizer", str(tokenizer),
                 "--set", "sliding_window=4", "--max-shard-size", "200000")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out"
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    HfCheckpoint(out)  # the index names every shard and tensor correctly
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["hidden_activation"] == "gelu_pytorch_tanh" and config["sliding_window"] == 4
    assert "eos_token_id" in json.loads((out / "generation_config.json").read_text())
    listing = run("inspect", str(FIXTURES / "gemma3_14l_scanned"))
    assert listing.returncode == 0, listing.stderr
    assert "scanned in blocks of 6" in listing.stdout and "14 layers" in listing.stdout
