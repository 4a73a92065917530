"""The compatibility layer's host-to-device puts, against jax.device_put."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_models.harness.stepper import load_plugins


def test_host_inputs_reach_the_device_as_device_put_places_them_and_as_copies():
    """tpu-inference's runner puts a step's inputs in tuples, then refills the
    same host buffers for the next step while this one may still run: the
    device must hold a copy, with the values, dtypes and sharding
    jax.device_put gives (adapt.host_portability.copy_host_inputs hands the copies to jit's
    own argument transfer instead)."""
    load_plugins()
    from tpu_inference.layers.common import utils

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    replicated = NamedSharding(mesh, P(None))
    host = (np.arange(8, dtype=np.int32), np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3),
            np.array([True, False]), np.arange(4, dtype=np.int64))
    want = jax.device_put(tuple(x.copy() for x in host), replicated)

    got = utils.general_device_put(host, replicated)
    for x in host:
        x[...] = 0  # the runner refilling its buffers
    assert isinstance(got, tuple) and len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.dtype, g.shape, g.sharding, g.committed) == (w.dtype, w.shape, w.sharding, True)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))  # exact: copies
    assert got[3].dtype == np.int32  # int64 canonicalized, as device_put does without x64

    # A bare PartitionSpec reads the mesh in context, as device_put does.
    with jax.set_mesh(mesh):
        spec = utils.general_device_put(np.arange(4, dtype=np.int32), P("data"))
    assert spec.sharding == NamedSharding(mesh, P("data"))
    np.testing.assert_array_equal(np.asarray(spec), np.arange(4))

    # Already on the device with that sharding, or one placing it alike (the runner
    # asks P("data") of its P() tokens, on a data axis of 1): returned as it is.
    assert utils.general_device_put(want[0], replicated) is want[0]
    alike = NamedSharding(mesh, P("data"))
    assert alike != replicated and want[0].sharding.is_equivalent_to(alike, 1)
    assert utils.general_device_put(want[0], alike) is want[0]
    # Traced (qwix quantizes the model under jit): device_put's own path.
    traced = jax.jit(lambda x: utils.general_device_put(x, replicated))(want[1])
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(want[1]))


@pytest.mark.e2e
def test_an_in_process_engine_exits_without_a_traceback():
    """vllm.LLM in-process walked the runner's (flax) model as a torch module
    when the engine was collected: every such run ended in an AttributeError
    traceback (adapt.engine.cleanup_of_torch_models_only). It ends while
    token buckets still compile in the background: the one under way is finished,
    no other starts, and nothing is printed after the script's last line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = ("import vllm\n"
              "from tpu_models.server.serve import DEFAULT_MODEL\n"
              "llm = vllm.LLM(model=str(DEFAULT_MODEL), dtype='float32', max_model_len=256,\n"
              "               max_num_batched_tokens=256, kv_cache_memory_bytes=16 << 20)\n"
              "out = llm.generate(['{\"name\":'], vllm.SamplingParams(max_tokens=4, temperature=0))\n"
              "print('TOKENS', len(out[0].outputs[0].token_ids))\n")
    # `python -c` from the repo root, as the export tests run theirs
    run = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1],
                         env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                              "SKIP_JAX_PRECOMPILE": "0"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compile in the background" in run.stdout + run.stderr  # buckets were left
    assert run.stdout.endswith("TOKENS 4\n"), run.stdout[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


# A tpu-inference other than the one the adaptations were written for, where one target
# of each serving feature changed its parameters: each feature is refused, the rest apply.
FAKED_UPSTREAM = """
import importlib.metadata, sys
real_version = importlib.metadata.version
importlib.metadata.version = lambda name: "0.99.0" if name == "tpu-inference" else real_version(name)
from tpu_inference.runner.kv_cache_manager import KVCacheManager
from tpu_inference.runner.lora_utils import LoraUtils
from tpu_inference.runner.speculative_decoding_manager import SpeculativeDecodingManager
from tpu_inference.runner.structured_decoding_manager import StructuredDecodingManager
from tpu_inference.spec_decode.jax.eagle3 import Eagle3Proposer
LoraUtils.extract_lora_metadata = lambda self, mapping: None
KVCacheManager.initialize_kv_cache = lambda self, config, groups: None
Eagle3Proposer._propose = lambda self, leaves: None
SpeculativeDecodingManager.take_draft_token_ids = lambda self, step: None
original_prepare = StructuredDecodingManager.prepare_structured_decoding_input

from vllm.engine.arg_utils import EngineArgs
from tpu_models import features
from tpu_models.harness.stepper import Stepper, load_plugins
from tpu_models.server.serve import DEFAULT_MODEL, EAGLE3_DRAFT
from tests.tiny import make_gemma3

load_plugins()  # the plugin: adapt.apply() on the faked version
print("REFUSED", sorted(features.refused()))
print("UNTOUCHED", KVCacheManager.get_kv_cache_spec.__module__)
print("APPLIED", StructuredDecodingManager.prepare_structured_decoding_input is not original_prepare)

def start(model, model_class, **args):
    config = EngineArgs(model=str(model), dtype="float32", max_model_len=256,
                        **args).create_engine_config()
    try:
        features.require(config, model_class)
        return "served"
    except features.AdaptationError as e:
        return str(e)

from tpu_models.qwen3_structural.model import Qwen3StructuralForCausalLM as Qwen3
from tpu_models.gemma3.model import Gemma3ForCausalLM as Gemma3
gemma3 = make_gemma3(sys.argv[1])
cases = {
    "plain": start(DEFAULT_MODEL, Qwen3),
    "lora": start(DEFAULT_MODEL, Qwen3, enable_lora=True, max_lora_rank=8),
    "gemma3": start(gemma3, Gemma3),
    "gemma3-unified": start(gemma3, Gemma3, disable_hybrid_kv_cache_manager=True),
    "eagle3": start(DEFAULT_MODEL, Qwen3, speculative_config={
        "method": "eagle3", "model": str(EAGLE3_DRAFT), "num_speculative_tokens": 3}),
    "ngram": start(DEFAULT_MODEL, Qwen3, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}),
}
for name, outcome in cases.items():
    print("CASE", name, "=", outcome)
# Through tpu-inference's own model build, as the engine starts one.
try:
    Stepper(DEFAULT_MODEL, enable_lora=True, max_lora_rank=8)
    print("BUILT lora")
except features.AdaptationError as e:
    print("BUILD-REFUSED", e)
"""


@pytest.mark.slow  # a process of its own, on a faked upstream
def test_on_another_tpu_inference_a_feature_whose_patch_cannot_apply_is_refused(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([sys.executable, "-c", FAKED_UPSTREAM, str(tmp_path / "gemma3")],
                         cwd=Path(__file__).parents[1], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)
    assert out["REFUSED"] == str(sorted([
        "EAGLE-3 drafts", "guided decoding beside speculative drafts",
        "per-request LoRA adapters (--enable-lora)",
        "the hybrid KV cache for sliding-window layers"]))
    # A refused feature's patches are all left out, even those whose targets matched;
    # the other features' patches apply.
    assert out["UNTOUCHED"] == "tpu_inference.runner.kv_cache_manager"
    assert out["APPLIED"] == "True"
    cases = dict(line.removeprefix("CASE ").split(" = ", 1)
                 for line in run.stdout.splitlines() if line.startswith("CASE "))
    assert cases["plain"] == cases["gemma3-unified"] == "served"
    for case, feature in [("lora", "per-request LoRA"), ("gemma3", "hybrid KV cache"),
                          ("eagle3", "EAGLE-3 drafts"),
                          ("ngram", "guided decoding beside speculative drafts")]:
        message = cases[case]
        assert feature in message and "0.99.0" in message and "0.32.0" in message, (case, message)
    assert "tpu-models: per-request LoRA" in out["BUILD-REFUSED"]
    assert "extract_lora_metadata takes (self mapping)" in out["BUILD-REFUSED"]


def test_off_tpu_a_host_portability_patch_that_cannot_apply_stops_the_engine(monkeypatch):
    import logging

    import pytest

    from tpu_models import features, patching
    installed = []
    broken = patching.Patch("example", features.OFF_TPU_HOST,
                            (patching.Target("tpu_models.host.has_tpu", "device"), ), "why",
                            "test", lambda: installed.append(1), platform=patching.OFF_TPU)
    monkeypatch.setattr(features, "_refused", {})
    with pytest.raises(features.AdaptationError, match=r"serving off-TPU .*host\.has_tpu takes \(\)"):
        patching.install([broken], logging.getLogger("test"))
    assert not installed
    # On a TPU host the same patch is not even considered.
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    patching.install([broken], logging.getLogger("test"))
    assert not installed and features.refused() == {}


def test_argmax_off_tpu_answers_as_numpy():
    """XLA:CPU's argmax is replaced by a max and a least position, a block at a time
    along a last axis that splits (off_tpu.first_max, installed by
    adapt.host_portability): the same index numpy gives, ties to the first, a NaN
    wins, over every axis and dtype."""
    load_plugins()
    import jax.numpy as jnp
    from jax import lax

    lowered = jax.jit(lambda x: jnp.argmax(x, axis=-1)).lower(np.zeros((2, 8), np.float32))
    assert "applies stablehlo.minimum" in lowered.as_text()  # ours, not a (value, index) reduce
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, size=(5, 7, 33)).astype(np.float32)  # many ties
    x[0, 0, 5] = x[1, 2, 0] = np.nan
    x[1, 2, 9] = np.nan
    x[2] = -np.inf
    x[3, 1, 31] = np.inf
    # A last axis searched a block at a time: 1,024-wide, 128-wide blocks.
    by_block = [rng.integers(-3, 4, size=(6, n)).astype(np.float32) for n in (4 * 1024, 37 * 128)]
    for y in by_block:
        y[1, [-1, 700, 5]] = 50  # ties across blocks: the first wins
        y[2] = -np.inf
        y[3, [-2, 900]] = np.nan  # the first NaN
        y[4, 10], y[4, -3] = np.inf, np.nan  # a NaN beats an earlier +inf
    cases = [x, x.astype(jnp.bfloat16), x[4].astype(np.int32), x[4] > 0,
             rng.normal(size=(3, 262144)).astype(np.float32), *by_block,
             by_block[0].astype(jnp.bfloat16)]
    for array in cases:
        for axis in range(array.ndim):
            got = np.asarray(jax.jit(lambda a: jnp.argmax(a, axis=axis))(array))
            want = np.argmax(np.asarray(array, np.float32) if array.dtype == jnp.bfloat16
                             else array, axis=axis)
            np.testing.assert_array_equal(got, want, err_msg=f"{array.dtype}, axis {axis}")
    # jnp.argmax's int64 indices under x64 off, and lax.argmax's own index dtype
    got = jax.jit(lambda a: lax.argmax(a, 0, jnp.int16))(x[4, 0])
    assert got.dtype == jnp.int16 and int(got) == int(np.argmax(x[4, 0]))


def test_across_hosts_the_buckets_left_compile_at_first_use(monkeypatch):
    """One CPU host compiles the buckets between the smallest and the largest in the
    background, its steps padded to the compiled ones meanwhile. Across hosts each
    would pad a step to the buckets it had compiled by then (different programs,
    broken collectives): there none compiles in the background, and a step keeps
    every bucket, compiled when a step first meets it, on every host at that step."""
    from types import SimpleNamespace

    from tpu_models import precompilation
    monkeypatch.setenv("TPU_MULTIHOST_BACKEND", "ray")
    runner = SimpleNamespace(num_tokens_paddings_per_dp=[1, 2, 4, 8])
    assert precompilation.rest_in_background(runner, [1, 2, 4, 8]) is None
    assert runner.num_tokens_paddings_per_dp == [1, 2, 4, 8]
