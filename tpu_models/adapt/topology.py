"""Compiling for a TPU topology: the slice's devices as this process's, every array as its shape.

`tpu-models compile` runs vLLM's engine start-up (the worker, the runner, its
KV-cache sizing and precompilation) in one process on any host, on a slice
libtpu describes with no chip behind it; the model is built abstractly and every
start-up program compiled by libtpu, none run (topology.abstract; what each chip
holds and the programs compiled: topology.accounting). Installed only in that
process (guard.COMPILING).
"""

from tpu_models.adapt.guard import COMPILING, COMPILE_ONLY, Patch, Target, rebind
from tpu_models.topology import abstract
from tpu_models.topology.accounting import HOST_INPUTS, KV_CACHE, WORKER, buffer, bytes_on

upstream: dict = {}  # the functions the replacements below fall back on


def slice_devices() -> None:
    import jax

    upstream.update(devices=jax.devices, local_devices=jax.local_devices)
    jax.devices, jax.local_devices = devices, local_devices


def devices(backend=None):
    """jax.devices: the slice's, unless a backend is named."""
    if backend is not None:
        return upstream["devices"](backend)
    return list(abstract.slice_devices())


def local_devices(process_index=None, backend=None, host_id=None):
    """jax.local_devices: the slice's of that process, unless a backend is named."""
    if backend is not None:
        return upstream["local_devices"](process_index, backend, host_id)
    index = process_index or host_id or 0
    return [d for d in abstract.slice_devices() if d.process_index == index]


def hbm_counted_from_shapes() -> None:
    rebind("tpu_inference.utils", "hbm_usage_bytes", hbm_usage_bytes)


def hbm_usage_bytes(devices):
    """tpu_inference.utils.hbm_usage_bytes: the live abstract buffers' bytes."""
    from tpu_inference import utils
    limit = utils.get_device_hbm_limit()  # the worker's own table, per device kind
    return [(bytes_on(d), limit) for d in devices]


def caches_and_inputs_as_shapes() -> None:
    from tpu_inference.layers.common import utils as layer_utils
    from tpu_inference.runner import kv_cache

    upstream.update(allocator=kv_cache._get_kv_cache_allocator,
                    device_put=layer_utils.general_device_put)
    kv_cache._get_kv_cache_allocator = _get_kv_cache_allocator
    kv_cache._get_mamba_cache_allocator = _get_kv_cache_allocator
    rebind(layer_utils.__name__, "general_device_put", general_device_put)


def _get_kv_cache_allocator(cache_shape, cache_dtype, sharding):
    """kv_cache's allocator: an abstract buffer (as it was inside a traced function,
    Qwix's calibration pass)."""
    import jax
    if abstract.tracing():
        return upstream["allocator"](cache_shape, cache_dtype, sharding)
    return lambda: buffer(jax.ShapeDtypeStruct(cache_shape, cache_dtype), sharding, KV_CACHE)


def general_device_put(tensor, sharding, *, layout=None, source_mesh=None):
    """general_device_put: host inputs as abstract buffers (a warm-up call's under its
    abstract mesh only)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    if abstract.tracing():
        return upstream["device_put"](tensor, sharding, layout=layout, source_mesh=source_mesh)
    if not isinstance(sharding, jax.sharding.Sharding):
        mesh = jax.sharding.get_mesh()
        if mesh.empty and abstract.warm_up_mesh() is not None:
            mesh = abstract.warm_up_mesh()
        sharding = NamedSharding(mesh, sharding or PartitionSpec())
    return jax.tree.map(lambda x: buffer(x, sharding, HOST_INPUTS), tensor)


def model_built_abstractly() -> None:
    from tpu_inference.models.common import model_loader
    from tpu_inference.worker.tpu_worker import TPUWorker

    model_loader._get_nnx_model = _get_nnx_model
    upstream["load_model"] = TPUWorker.load_model
    TPUWorker.load_model = load_model


def _get_nnx_model(model_class, vllm_config, rng, mesh, pooler=None, is_draft_model=False):
    """model_loader._get_nnx_model: the model built abstractly."""
    return abstract.build_model(model_class, vllm_config, rng, mesh, is_draft_model)


def load_model(self):
    """TPUWorker.load_model, the worker kept for the report."""
    WORKER[:] = [self]
    return upstream["load_model"](self)


def programs_compiled_not_run() -> None:
    from tpu_inference.runner.compilation_manager import CompilationManager

    CompilationManager._create_dummy_tensor = _create_dummy_tensor
    CompilationManager._run_compilation = _run_compilation
    CompilationManager._flush_compilations = _flush_compilations


def _create_dummy_tensor(self, shape, dtype, sharding=None):
    return abstract.dummy_tensor(self.runner.mesh, shape, dtype, sharding)


def _run_compilation(self, name, fn, *args, call_kwargs=dict(), warmup_handler=None,
                     aot=True, compile_only=False, **kwargs):
    abstract.compile_program(self, name, fn, args, call_kwargs, warmup_handler, kwargs)


def _flush_compilations(self):
    abstract.warm_up(self)


def warmed_up_jits_compiled() -> None:
    from jax._src.interpreters import pxla

    upstream["unsafe_call"] = pxla.MeshExecutable.unsafe_call.fget
    pxla.MeshExecutable.unsafe_call = property(unsafe_call)


def unsafe_call(self):
    """MeshExecutable.unsafe_call: during a warm-up call, compiled for the slice."""
    build = upstream["unsafe_call"]
    if not abstract.WARMING:
        return build(self)

    def call(*args):
        outputs = abstract.compiled_for_the_slice(self, args)
        return build(self)(*args) if outputs is None else outputs

    return call


def precompilation_eager_on_host() -> None:
    import jax
    from tpu_inference.runner import compilation_manager

    compilation_manager.jax = abstract.JaxEagerOnHost(jax)


def draft_embedding_from_its_checkpoint() -> None:
    from tpu_inference.spec_decode.jax import eagle3

    upstream["draft_load_model"] = eagle3.Eagle3Proposer.load_model
    eagle3.Eagle3Proposer.load_model = draft_load_model


def draft_load_model(self, target_model):
    """Eagle3Proposer.load_model, its embedding check answered by the checkpoint."""
    from tpu_inference.spec_decode.jax import eagle3
    draft = self.vllm_config.speculative_config.draft_model_config.model
    answers = abstract.EmbeddingAnswers(eagle3.jnp, abstract.ships_embedding(draft))
    eagle3.jnp = answers
    try:
        return upstream["draft_load_model"](self, target_model)
    finally:
        eagle3.jnp = answers.real


# The test that fails without each patch.
TESTS = {
    "the slice's devices as this process's": "test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8",
    "HBM in use counted from shapes": "test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8",
    "KV cache and host inputs as shapes": "test_gemma3_hybrid_cache_in_fp8_with_lora_slots_on_v5e_1",
    "model built abstractly": "test_int8_qwen3_at_tensor_parallel_4_in_the_kv_budget_asked",
    "EAGLE-3 draft embedding decided by its checkpoint": "test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8",
    "programs compiled, kept, never run": "test_the_program_set_is_what_a_cpu_server_precompiles",
    "warm-up calls compile their jits, run none": "test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8",
    "precompilation's eager arrays made on the host": "test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8",
}


def _patch(name, targets, why, install):
    return Patch(name, COMPILE_ONLY, tuple(Target(*t) for t in targets), why,
                 f"tests/test_compile.py::{TESTS[name]}", install, platform=COMPILING)


MANAGER = "tpu_inference.runner.compilation_manager.CompilationManager"
_RUN = "self name fn args call_kwargs warmup_handler aot compile_only kwargs"
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
    _patch("model built abstractly", [
        ("tpu_inference.models.common.model_loader._get_nnx_model",
         "model_class vllm_config rng mesh pooler is_draft_model"),
        ("tpu_inference.models.jax.utils.qwix.qwix_utils.apply_qwix_quantization",
         "vllm_config model_or_model_fn rng mesh apply_to_abstract_model"),
        ("tpu_inference.models.jax.utils.qwix.qwix_utils.apply_qwix_on_abstract_model",
         "vllm_config"),
        ("tpu_inference.worker.tpu_worker.TPUWorker.load_model", "self")],
        "loading writes weights into device memory the slice does not have",
        model_built_abstractly),
    _patch("EAGLE-3 draft embedding decided by its checkpoint", [
        ("tpu_inference.spec_decode.jax.eagle3.Eagle3Proposer.load_model", "self target_model")],
        "the drafter borrows the target's embedding if its own is all zeros: values, absent here",
        draft_embedding_from_its_checkpoint),
    _patch("programs compiled, kept, never run", [
        (f"{MANAGER}._run_compilation", _RUN), (f"{MANAGER}._flush_compilations", "self"),
        (f"{MANAGER}._create_dummy_tensor", "self shape dtype sharding"),
        ("tpu_inference.runner.compilation_manager._describe_signature", "kwargs")],
        "precompilation runs every program once on dummy inputs after compiling it",
        programs_compiled_not_run),
    _patch("warm-up calls compile their jits, run none", [
        ("jax._src.interpreters.pxla.MeshExecutable.unsafe_call.fget", "self")],
        "a function that is no jit compiles its jits when the warm-up pass calls it",
        warmed_up_jits_compiled),
    _patch("precompilation's eager arrays made on the host", [
        (f"{MANAGER}.capture_model", "self"), ("jax.set_mesh", "mesh")],
        "an array made eagerly under the slice's mesh (jnp.ones) cannot be made: no chip",
        precompilation_eager_on_host),
]
