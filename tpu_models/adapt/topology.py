"""Compiling for a TPU topology: the slice's devices as this process's, every array as its shape."""

from tpu_models.features import COMPILE_ONLY
from tpu_models.patching import COMPILING, Patch, Target
from tpu_models.topology import abstract


def slice_devices(original, backend=None):
    """jax.devices: the slice's, unless a backend is named."""
    return original(backend) if backend is not None else list(abstract.slice_devices())


def local_slice_devices(original, process_index=None, backend=None, host_id=None):
    """jax.local_devices: the slice's of that process, unless a backend is named."""
    if backend is not None:
        return original(process_index, backend, host_id)
    return abstract.local_slice_devices(process_index or host_id or 0)


def hbm_usage_of_shapes(original, devices):
    """tpu_inference.utils.hbm_usage_bytes: the live abstract buffers' bytes."""
    return abstract.hbm_usage(devices)


def cache_allocated_as_shapes(original, cache_shape, cache_dtype, sharding):
    """kv_cache's allocators: an abstract buffer (when traced, as it was: Qwix's calibration)."""
    if abstract.tracing():
        return original(cache_shape, cache_dtype, sharding)
    return abstract.kv_cache_allocator(cache_shape, cache_dtype, sharding)


def put_as_shapes(original, tensor, sharding, *, layout=None, source_mesh=None):
    """general_device_put: host inputs as abstract buffers (as it was when traced)."""
    if abstract.tracing():
        return original(tensor, sharding, layout=layout, source_mesh=source_mesh)
    return abstract.device_put(tensor, sharding)


def model_built_abstractly(original, model_class, vllm_config, rng, mesh, pooler=None,
                           is_draft_model=False):
    """model_loader._get_nnx_model: the model built abstractly."""
    return abstract.build_model(model_class, vllm_config, rng, mesh, is_draft_model)


def load_model_keeping_the_worker(original, self):
    """TPUWorker.load_model, the worker kept for the report."""
    abstract.keep_worker(self)
    return original(self)


def dummy_tensor_as_shape(original, self, shape, dtype, sharding=None):
    """CompilationManager._create_dummy_tensor: an abstract buffer."""
    return abstract.dummy_tensor(self.runner.mesh, shape, dtype, sharding)


# adapt.compilation's replacements of the same two targets wrap these (installed later).
def compiled_not_run(original, self, name, fn, *args, call_kwargs=dict(), warmup_handler=None,
                     aot=True, compile_only=False, **kwargs):
    """CompilationManager._run_compilation: lowered and compiled for the slice, kept."""
    abstract.compile_program(self, name, fn, args, call_kwargs, warmup_handler, kwargs)


def warmed_up_with_shapes(original, self):
    """CompilationManager._flush_compilations: the warm-up calls made with shapes."""
    abstract.warm_up(self)


def draft_load_model(original, self, target_model):
    """Eagle3Proposer.load_model, its embedding check answered by the checkpoint."""
    from tpu_inference.spec_decode.jax import eagle3
    draft = self.vllm_config.speculative_config.draft_model_config.model
    with abstract.draft_embedding_answered(eagle3, draft):
        return original(self, target_model)


def _patch(name, test, targets, why, install=None):
    return Patch(name, COMPILE_ONLY, tuple(Target(*t) for t in targets), why,
                 f"tests/test_compile.py::{test}", install, platform=COMPILING)


MANAGER = "tpu_inference.runner.compilation_manager.CompilationManager"
_RUN = "self name fn args call_kwargs warmup_handler aot compile_only kwargs"
_CACHE = "cache_shape cache_dtype sharding"
_EAGLE3_TP8 = "test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8"
PATCHES = [
    _patch("the slice's devices as this process's", _EAGLE3_TP8, [
        ("jax.devices", "backend", slice_devices),
        ("jax.local_devices", "process_index backend host_id", local_slice_devices)],
        "the worker takes jax.devices(), and kernels read its device kind: the host's CPU"),
    _patch("HBM in use counted from shapes", _EAGLE3_TP8, [
        ("tpu_inference.utils.hbm_usage_bytes", "devices", hbm_usage_of_shapes),
        ("tpu_inference.utils.get_device_hbm_limit", "")],
        "memory_stats() needs a chip; the KV budget is HBM less what the weights take"),
    _patch("KV cache and host inputs as shapes",
           "test_gemma3_hybrid_cache_in_fp8_with_lora_slots_on_v5e_1", [
        ("tpu_inference.runner.kv_cache._get_kv_cache_allocator", _CACHE,
         cache_allocated_as_shapes),
        ("tpu_inference.runner.kv_cache._get_mamba_cache_allocator", _CACHE,
         cache_allocated_as_shapes),
        ("tpu_inference.layers.common.utils.general_device_put",
         "tensor sharding layout source_mesh", put_as_shapes)],
        "the cache is allocated and host arrays put on devices the slice does not have"),
    _patch("model built abstractly",
           "test_int8_qwen3_at_tensor_parallel_4_in_the_kv_budget_asked", [
        ("tpu_inference.models.common.model_loader._get_nnx_model",
         "model_class vllm_config rng mesh pooler is_draft_model", model_built_abstractly),
        ("tpu_inference.models.jax.utils.qwix.qwix_utils.apply_qwix_quantization",
         "vllm_config model_or_model_fn rng mesh apply_to_abstract_model"),
        ("tpu_inference.models.jax.utils.qwix.qwix_utils.apply_qwix_on_abstract_model",
         "vllm_config"),
        ("tpu_inference.worker.tpu_worker.TPUWorker.load_model", "self",
         load_model_keeping_the_worker)],
        "loading writes weights into device memory the slice does not have"),
    _patch("EAGLE-3 draft embedding decided by its checkpoint", _EAGLE3_TP8, [
        ("tpu_inference.spec_decode.jax.eagle3.Eagle3Proposer.load_model", "self target_model",
         draft_load_model)],
        "the drafter borrows the target's embedding if its own is all zeros: values, absent here"),
    _patch("programs compiled, kept, never run",
           "test_the_program_set_is_what_a_cpu_server_precompiles", [
        (f"{MANAGER}._run_compilation", _RUN, compiled_not_run),
        (f"{MANAGER}._flush_compilations", "self", warmed_up_with_shapes),
        (f"{MANAGER}._create_dummy_tensor", "self shape dtype sharding", dummy_tensor_as_shape),
        ("tpu_inference.runner.compilation_manager._describe_signature", "kwargs")],
        "precompilation runs every program once on dummy inputs after compiling it"),
    _patch("warm-up calls compile their jits, run none", _EAGLE3_TP8, [
        ("jax._src.interpreters.pxla.MeshExecutable.unsafe_call.fget", "self")],
        "a function that is no jit compiles its jits when the warm-up pass calls it",
        abstract.warmed_up_jits_compiled),
    _patch("precompilation's eager arrays made on the host", _EAGLE3_TP8, [
        (f"{MANAGER}.capture_model", "self"), ("jax.set_mesh", "mesh")],
        "an array made eagerly under the slice's mesh (jnp.ones) cannot be made: no chip",
        abstract.precompilation_eager_on_host),
]
