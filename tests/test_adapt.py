"""The compatibility layer's host-to-device puts, against jax.device_put."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_models.benchmarks.stepper import load_plugins


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
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert got[3].dtype == np.int32  # int64 canonicalized, as device_put does without x64

    # A bare PartitionSpec reads the mesh in context, as device_put does.
    with jax.set_mesh(mesh):
        spec = utils.general_device_put(np.arange(4, dtype=np.int32), P("data"))
    assert spec.sharding == NamedSharding(mesh, P("data"))
    np.testing.assert_array_equal(np.asarray(spec), np.arange(4))

    # Already on the device with that sharding: returned as it is.
    assert utils.general_device_put(want[0], replicated) is want[0]
    # Traced (qwix quantizes the model under jit): device_put's own path.
    traced = jax.jit(lambda x: utils.general_device_put(x, replicated))(want[1])
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(want[1]))


def test_an_in_process_engine_exits_without_a_traceback():
    """vllm.LLM in-process walked the runner's (flax) model as a torch module
    when the engine was collected: every such run ended in an AttributeError
    traceback (adapt.engine.engine_cleanup_of_torch_models_only)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = ("import vllm\n"
              "from tpu_models.server.serve import DEFAULT_MODEL\n"
              "llm = vllm.LLM(model=str(DEFAULT_MODEL), dtype='float32', max_model_len=64,\n"
              "               kv_cache_memory_bytes=16 << 20)\n"
              "out = llm.generate(['{\"name\":'], vllm.SamplingParams(max_tokens=4, temperature=0))\n"
              "print('TOKENS', len(out[0].outputs[0].token_ids))\n")
    # `python -c` from the repo root, as the export tests run theirs
    run = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1],
                         env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TOKENS 4" in run.stdout, run.stdout[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
