"""Host portability: tpu-inference's TPU-only assumptions, adapted off-TPU.

libtpu ships with tpu-inference, so vLLM picks its TPU platform on any host;
with JAX_PLATFORMS=cpu (or cuda) the engine then runs on that JAX backend until
one of these assumptions stops it, or lets it run and return wrong tokens (host
inputs). None of this is installed on a TPU.
"""

import importlib
import os

from tpu_models.adapt.guard import OFF_TPU, OFF_TPU_HOST, Patch, Target, rebind
from tpu_models.host import host_platform

# Default KV-cache budget off-TPU: a share of the host's memory, at most a share of
# what is available at start-up.
KV_CACHE_SHARE, KV_CACHE_SHARE_OF_AVAILABLE = 0.2, 0.5
# ... and under TPU_MODELS_ATTENTION=rpa-interpret: JAX's interpreter copies the whole
# cache into its simulated memory at every attention call (about 20x its size in RSS),
# so 20% of a 24 GB host (4.8 GB of cache) met the OOM killer at the first prompts.
# There the cache holds two requests at --max-model-len, and at least 32 MiB.
INTERPRETED_KV_CACHE_BYTES, INTERPRETED_REQUESTS = 32 << 20, 2


def _logger():
    from tpu_inference.logger import init_logger
    return init_logger("tpu_models.adapt")


def mesh_without_coords() -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    def make_mesh(axis_shapes, axis_names, *, devices=None):
        devices = sorted(devices if devices is not None else jax.devices(), key=lambda d: d.id)
        return Mesh(np.asarray(devices).reshape(axis_shapes), axis_names)

    rebind("tpu_inference.utils", "make_optimized_mesh", make_mesh)


def kv_cache_budget(cache_config, request_bytes: int = 0) -> int:
    """Bytes for the KV cache: --kv-cache-memory-bytes, else 20% of the host's memory (at
    most half of what is available), rounded down to whole GiB (256 MiB below 1 GiB).
    The cache's size is part of every compiled step's shapes: a budget that moved with
    free memory made a restart miss the JAX cache for the whole model. Interpreted
    (rpa-interpret): two requests of `request_bytes` (one at --max-model-len), 32 MiB
    at least, in whole MiB."""
    if cache_config.kv_cache_memory_bytes:
        return int(cache_config.kv_cache_memory_bytes)
    from tpu_models.host import attention_mode
    if attention_mode() == "rpa-interpret":
        mib = -(-INTERPRETED_REQUESTS * request_bytes // 2**20)  # rounded up
        return max(INTERPRETED_KV_CACHE_BYTES, mib * 2**20)
    import psutil
    memory = psutil.virtual_memory()
    share = int(min(memory.total * KV_CACHE_SHARE, memory.available * KV_CACHE_SHARE_OF_AVAILABLE))
    quantum = 2**30 if share >= 2**30 else 2**28
    return max(quantum, share - share % quantum)


def memory_from_host() -> None:
    import jax
    import psutil
    from tpu_inference.platforms.tpu_platform import TpuPlatform
    from tpu_inference.worker.tpu_worker import TPUWorker

    from tpu_models.host import attention_mode

    platform = host_platform()

    def usage(devices):
        # Live arrays per device against the host's RAM (devices share it).
        used = {}
        for array in jax.live_arrays():
            for shard in array.addressable_shards:
                used[shard.device] = used.get(shard.device, 0) + shard.data.nbytes
        total = psutil.virtual_memory().total
        return [(used.get(d, 0), total) for d in devices]

    def determine_available_memory(self) -> int:
        request = sum(spec.max_memory_usage_bytes(self.vllm_config)
                      for spec in self.get_kv_cache_spec().values())
        budget = kv_cache_budget(self.cache_config, request)
        if self.cache_config.kv_cache_memory_bytes:
            _logger().info("tpu-models: KV cache budget on this %s host: %.2f GiB", platform,
                           budget / 2**30)
        elif attention_mode() == "rpa-interpret":
            _logger().warning("tpu-models: KV cache budget %d MiB: the Pallas interpreter copies "
                              "the whole cache at every call (set it with "
                              "--kv-cache-memory-bytes)", budget >> 20)
        else:  # a guess: say how to choose
            _logger().warning("tpu-models: KV cache budget on this %s host: %.2f GiB, %d%% of "
                              "its memory in whole GiB (set it with --kv-cache-memory-bytes)",
                              platform, budget / 2**30, KV_CACHE_SHARE * 100)
        return budget

    def mem_get_info(cls):
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    rebind("tpu_inference.utils", "hbm_usage_bytes", usage)
    TPUWorker.determine_available_memory = determine_available_memory
    TpuPlatform.mem_get_info = classmethod(mem_get_info)
    TpuPlatform.get_device_name = classmethod(lambda cls, device_id=0: platform.upper())


def no_tpu_compiler_options() -> None:
    import jax

    module = "tpu_inference.models.common.compiler_options"
    rebind(module, "get_step_fn_compiler_options", lambda: {})
    rebind(module, "get_sampling_compiler_options", lambda: {})
    # The sampler took its options when it was decorated, at import (before plugins
    # load): jit it again without them. So did EAGLE-3's draft loop, whose
    # replacement (adapt.speculative) is jitted without them.
    sampling = importlib.import_module("tpu_inference.layers.jax.sample.sampling")
    rebind(sampling.__name__, "sample",
           jax.jit(sampling.sample.__wrapped__,
                   static_argnames=["mesh", "allow_distributed_sampling"]))


def copy_host_inputs() -> None:
    # The runner refills its host buffers for step N+1 while step N may still run;
    # on CPU device_put may alias a numpy buffer, so the step would read the new
    # values. Each host array is copied, and the copies go over with jit's own
    # argument transfer (shard_args, jaxlib's): device_put's Python path cost a
    # quarter of a demo step (benchmarks/README.md).
    import jax
    import numpy as np
    from jax._src.lib import _jax
    from jax.sharding import NamedSharding, PartitionSpec, Sharding
    from tpu_inference import envs

    module = importlib.import_module("tpu_inference.layers.common.utils")
    original = module.general_device_put
    reuse = _jax.ArrayCopySemantics.REUSE_INPUT  # the copy below is ours alone

    def put_each(shardings, _layouts, _semantics, arrays):
        return [jax.device_put(x, s) for x, s in zip(arrays, shardings)]

    def copy(x):
        return np.array(x, dtype=jax.dtypes.canonicalize_dtype(x.dtype)) if isinstance(
            x, np.ndarray) else x

    def general_device_put(tensor, sharding, *, layout=None, source_mesh=None):
        leaves, tree = jax.tree.flatten(tensor)
        copies = [copy(x) for x in leaves]
        if layout is not None or envs.TPU_MULTIHOST_BACKEND == "ray":
            return original(jax.tree.unflatten(tree, copies), sharding, layout=layout,
                            source_mesh=source_mesh)
        if isinstance(sharding, PartitionSpec) and not (mesh := jax.sharding.get_mesh()).empty:
            sharding = NamedSharding(mesh, sharding)  # the mesh device_put reads a bare spec in
        if isinstance(sharding, Sharding):
            # Already there: device_put's answer, without its Python path. Equivalent
            # counts: the runner asks P("data") of a P() array on a data axis of 1
            # (78-101 us a decode step for the async token substitution).
            if all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                   and x.committed and x.sharding.is_equivalent_to(sharding, x.ndim)
                   for x in leaves):
                return tensor
            if all(isinstance(x, np.ndarray) for x in copies):
                n = len(copies)
                return jax.tree.unflatten(tree, _jax.shard_args(
                    [sharding] * n, [None] * n, [reuse] * n, copies, fallback=put_each))
        return jax.device_put(jax.tree.unflatten(tree, copies), sharding)

    rebind(module.__name__, "general_device_put", general_device_put)


def portable_default_attention() -> None:
    from tpu_inference.layers.common.attention_backend import RPAAttentionBackend

    from tpu_models.host import attention_mode
    if attention_mode() != "portable":  # the RPA backend as on a TPU (adapt.rpa_kernel)
        return

    from tpu_models.attention import PortableAttentionBackend

    portable = PortableAttentionBackend()
    RPAAttentionBackend.get_kv_cache_shape = lambda self, *a: portable.get_kv_cache_shape(*a)
    RPAAttentionBackend.attention = lambda self, *a, **kw: portable.attention(*a, **kw)


def small_token_buckets() -> None:
    # A TPU computes a 16-row step for the price of one, a CPU pays every padded row.
    os.environ.setdefault("MIN_TOKEN_BUCKET", "1")


def argmax_as_two_reductions() -> None:
    # XLA:CPU lowers argmax to a (value, index) reduce it does not vectorize:
    # 1.07 ms over Gemma 3's 262k vocabulary against 0.1 ms for a max, then the
    # least position holding it (greedy sampling, rejection, drafts, categorical).
    # Same answer: the first maximum, or the first NaN where there is one.
    import jax.numpy as jnp
    from jax import lax
    from jax.interpreters import mlir

    def first_max(operand, *, axes, index_dtype):
        axis, = axes
        hit = operand == jnp.max(operand, axis=axis, keepdims=True)
        if jnp.issubdtype(operand.dtype, jnp.floating):
            nan = jnp.isnan(operand)
            hit = jnp.where(jnp.any(nan, axis=axis, keepdims=True), nan, hit)
        positions = lax.broadcasted_iota(index_dtype, operand.shape, axis)
        return jnp.min(jnp.where(hit, positions, jnp.iinfo(index_dtype).max), axis=axis)

    mlir.register_lowering(lax.argmax_p, mlir.lower_fun(first_max, multiple_results=False),
                           platform="cpu")


def _patch(name, targets, why, test, install, speed=""):
    return Patch(name, OFF_TPU_HOST, tuple(Target(*t) for t in targets), why, test, install,
                 platform=OFF_TPU, speed=speed)


UTILS = "tpu_inference.utils"
PATCHES = [
    _patch("mesh without device coords", [(f"{UTILS}.make_optimized_mesh",
                                            "axis_shapes axis_names devices")],
           "the mesh sorts devices by .coords, which only TPU devices have",
           "tests/test_tensor_parallel.py::test_greedy_tokens_equal_across_tensor_parallel_sizes", mesh_without_coords),
    _patch("memory sized from the host", [
        (f"{UTILS}.hbm_usage_bytes", "devices"),
        ("tpu_inference.worker.tpu_worker.TPUWorker.determine_available_memory", "self"),
        ("tpu_inference.platforms.tpu_platform.TpuPlatform.mem_get_info", ""),
        ("tpu_inference.platforms.tpu_platform.TpuPlatform.get_device_name", "device_id")],
        "memory sizing asks for TPU HBM and raises 'Expected TPU devices'",
        "tests/test_serve_e2e.py::test_concurrent_greedy_matches_transformers", memory_from_host),
    _patch("no xla_tpu_* compiler options", [
        ("tpu_inference.models.common.compiler_options.get_step_fn_compiler_options", ""),
        ("tpu_inference.models.common.compiler_options.get_sampling_compiler_options", ""),
        ("tpu_inference.layers.jax.sample.sampling.sample",
         "rng mesh logits tpu_sampling_metadata allow_distributed_sampling")],
        "XLA off-TPU refuses the xla_tpu_* options baked into jitted functions",
        "tests/test_serve_e2e.py::test_concurrent_greedy_matches_transformers",
        no_tpu_compiler_options),
    _patch("host inputs copied before the step", [
        ("tpu_inference.layers.common.utils.general_device_put",
         "tensor sharding layout source_mesh")],
        "on CPU the step could read host buffers the runner refills for the next step",
        "tests/test_adapt.py::test_host_inputs_reach_the_device_as_device_put_places_them_and_as_copies", copy_host_inputs),
    _patch("portable kernel for tpu-inference's models", [
        ("tpu_inference.layers.common.attention_backend.RPAAttentionBackend.attention",
         "self args kwargs"),
        ("tpu_inference.layers.common.attention_backend.RPAAttentionBackend.get_kv_cache_shape",
         "self total_num_pages page_size num_kv_heads head_dim kv_dtype")],
        "tpu-inference's own models hard-code the Pallas TPU kernel (RPA v3)",
        "tests/test_serve_e2e.py::test_builtin_qwen3_through_the_same_portability_layer", portable_default_attention),
    _patch("argmax as two reductions", [
        ("jax.interpreters.mlir.register_lowering", "prim rule platform inline cacheable")],
        "XLA:CPU's argmax, a scalar loop: 1 ms a greedy token over a 262k vocabulary",
        "tests/test_adapt.py::test_argmax_off_tpu_answers_as_numpy", argmax_as_two_reductions,
        speed="tpu-models bench step"),
    _patch("token buckets from 1", [], "a lone decode paid for 16 padded rows of matmuls",
           "tests/test_serve_e2e.py::test_concurrent_greedy_matches_transformers",
           small_token_buckets, speed="tpu-models bench step"),
]
