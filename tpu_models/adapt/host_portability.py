"""Host portability: tpu-inference's TPU-only assumptions, adapted off-TPU.

libtpu ships with tpu-inference, so vLLM picks its TPU platform on any host;
with JAX_PLATFORMS=cpu (or cuda) the engine then runs on that JAX backend until
one of these assumptions stops it, or lets it run and return wrong tokens (host
inputs). None of this is installed on a TPU.
"""

import importlib
import os

from tpu_models import off_tpu
from tpu_models.adapt.guard import OFF_TPU, OFF_TPU_HOST, Patch, Target, rebind
from tpu_models.host import host_platform

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


def memory_from_host() -> None:
    from tpu_inference.platforms.tpu_platform import TpuPlatform
    from tpu_inference.worker.tpu_worker import TPUWorker

    rebind("tpu_inference.utils", "hbm_usage_bytes", off_tpu.memory_in_use)
    TPUWorker.determine_available_memory = determine_available_memory
    TpuPlatform.mem_get_info = classmethod(mem_get_info)
    TpuPlatform.get_device_name = classmethod(get_device_name)


def determine_available_memory(self) -> int:
    """TPUWorker.determine_available_memory: the KV cache's budget on this host, said."""
    from tpu_models.host import attention_mode
    request = sum(spec.max_memory_usage_bytes(self.vllm_config)
                  for spec in self.get_kv_cache_spec().values())
    budget = off_tpu.kv_cache_budget(self.cache_config, request)
    platform = host_platform()
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
                          platform, budget / 2**30, off_tpu.KV_CACHE_SHARE * 100)
    return budget


def mem_get_info(cls):
    """TpuPlatform.mem_get_info: the host's memory."""
    import psutil
    memory = psutil.virtual_memory()
    return memory.available, memory.total


def get_device_name(cls, device_id=0):
    return host_platform().upper()


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
    module = importlib.import_module("tpu_inference.layers.common.utils")
    upstream["device_put"] = module.general_device_put
    rebind(module.__name__, "general_device_put", general_device_put)


upstream: dict = {}  # tpu-inference's general_device_put


def general_device_put(tensor, sharding, *, layout=None, source_mesh=None):
    """general_device_put: host arrays copied before the step reads them (off_tpu)."""
    from tpu_inference import envs
    if layout is not None or envs.TPU_MULTIHOST_BACKEND == "ray":
        return upstream["device_put"](off_tpu.copied(tensor), sharding, layout=layout,
                                      source_mesh=source_mesh)
    return off_tpu.put_copies(tensor, sharding)


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
    # XLA:CPU's argmax is a scalar loop (greedy sampling, rejection, drafts,
    # categorical); off_tpu.first_max gives the same answer in two reductions.
    from jax.interpreters import mlir

    primitive, rule = off_tpu.argmax_lowering()
    mlir.register_lowering(primitive, rule, platform="cpu")


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
