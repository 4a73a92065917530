"""Compiling for a TPU topology: the slice's devices as this process's, every array as its shape.

`tpu-models compile` runs vLLM's engine start-up (the worker, the runner, its
KV-cache sizing and precompilation) in one process on any host. The devices
are a TPU slice's as libtpu describes it (jax.experimental.topologies), with no
chip behind them. Every array the start-up would allocate (weights, KV cache,
host inputs, precompilation's dummy tensors) is a ShapeDtypeStruct placed on
them, alive while something refers to it, and HBM in use is counted from the
live ones (the buffers and their count: tpu_models.slice_accounting).
adapt.topology_programs builds the model and compiles the programs.
Installed only in that process (guard.COMPILING).
"""

from tpu_models.adapt.guard import COMPILING, COMPILE_ONLY, Patch, Target, rebind
from tpu_models.slice_accounting import HOST_INPUTS, KV_CACHE, buffer, bytes_on

_devices: list = []

# The warm-up call under way (adapt.topology_programs): its task, mesh, what it holds.
WARMING: list = []


def _tracing() -> bool:
    from jax._src import core
    return not core.trace_state_clean()


def _slice_devices() -> list:
    """The devices libtpu describes for the slice (first use: vLLM also loads this
    plugin in helper processes that never ask for devices)."""
    if not _devices:
        from jax.experimental import topologies

        from tpu_models.host import compile_target
        from tpu_models.topologies import topology

        slice_ = topology(compile_target())
        found = topologies.get_topology_desc(platform="tpu", topology_name=slice_.libtpu_name,
                                             chips_per_host_bounds=slice_.host_chips).devices
        _devices[:] = sorted(found, key=lambda d: d.id)
    return _devices


def slice_devices() -> None:
    import jax

    host_devices, host_local = jax.devices, jax.local_devices

    def devices_(backend=None):
        return host_devices(backend) if backend is not None else list(_slice_devices())

    def local_devices(process_index=None, backend=None, host_id=None):
        if backend is not None:
            return host_local(process_index, backend, host_id)
        index = process_index or host_id or 0
        return [d for d in _slice_devices() if d.process_index == index]

    jax.devices, jax.local_devices = devices_, local_devices


def hbm_counted_from_shapes() -> None:
    from tpu_inference import utils

    def hbm_usage_bytes(devices):
        limit = utils.get_device_hbm_limit()  # the worker's own table, per device kind
        return [(bytes_on(d), limit) for d in devices]

    rebind("tpu_inference.utils", "hbm_usage_bytes", hbm_usage_bytes)


def caches_and_inputs_as_shapes() -> None:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from tpu_inference.layers.common import utils as layer_utils
    from tpu_inference.runner import kv_cache

    allocator = kv_cache._get_kv_cache_allocator

    def _get_kv_cache_allocator(cache_shape, cache_dtype, sharding):
        if _tracing():  # inside a traced function (Qwix's calibration pass): as it was
            return allocator(cache_shape, cache_dtype, sharding)
        return lambda: buffer(jax.ShapeDtypeStruct(cache_shape, cache_dtype), sharding,
                              KV_CACHE)

    put = layer_utils.general_device_put

    def general_device_put(tensor, sharding, *, layout=None, source_mesh=None):
        if _tracing():
            return put(tensor, sharding, layout=layout, source_mesh=source_mesh)
        if not isinstance(sharding, jax.sharding.Sharding):
            mesh = jax.sharding.get_mesh()
            if mesh.empty and WARMING:  # a warm-up call: under its abstract mesh only
                mesh = WARMING[1]
            sharding = NamedSharding(mesh, sharding or PartitionSpec())
        return jax.tree.map(lambda x: buffer(x, sharding, HOST_INPUTS), tensor)

    kv_cache._get_kv_cache_allocator = _get_kv_cache_allocator
    kv_cache._get_mamba_cache_allocator = _get_kv_cache_allocator
    rebind(layer_utils.__name__, "general_device_put", general_device_put)


# The test that fails without each patch.
TESTS = {
    "the slice's devices as this process's": "test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8",
    "HBM in use counted from shapes": "test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8",
    "KV cache and host inputs as shapes": "test_gemma3_hybrid_cache_in_fp8_with_lora_slots_on_v5e_1",
}


def _patch(name, targets, why, install):
    return Patch(name, COMPILE_ONLY, tuple(Target(*t) for t in targets), why,
                 f"tests/test_compile.py::{TESTS[name]}", install, platform=COMPILING)


PATCHES = [
    _patch("the slice's devices as this process's", [
        ("jax.devices", "backend"), ("jax.local_devices", "process_index backend host_id")],
        "the worker takes jax.devices(), and kernels read its device kind: the host's CPU",
        slice_devices),
    _patch("HBM in use counted from shapes", [
        ("tpu_inference.utils.hbm_usage_bytes", "devices"),
        ("tpu_inference.utils.get_device_hbm_limit", "")],
        "memory_stats() needs a chip; the KV budget is HBM less what the weights take",
        hbm_counted_from_shapes),
    _patch("KV cache and host inputs as shapes", [
        ("tpu_inference.runner.kv_cache._get_kv_cache_allocator",
         "cache_shape cache_dtype sharding"),
        ("tpu_inference.runner.kv_cache._get_mamba_cache_allocator",
         "cache_shape cache_dtype sharding"),
        ("tpu_inference.layers.common.utils.general_device_put",
         "tensor sharding layout source_mesh")],
        "the cache is allocated and host arrays put on devices the slice does not have",
        caches_and_inputs_as_shapes),
]
