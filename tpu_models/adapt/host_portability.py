"""Host portability: tpu-inference's TPU-only assumptions, adapted off-TPU.

Each is answered by tpu_models.off_tpu; none of this is installed on a TPU.
"""

from tpu_models import off_tpu
from tpu_models.features import OFF_TPU_HOST
from tpu_models.host import attention_mode, host_platform
from tpu_models.patching import OFF_TPU, Patch, Target


def mesh_by_device_id(original, axis_shapes, axis_names, *, devices=None):
    """make_optimized_mesh: sorted by id, not by TPU coordinates."""
    return off_tpu.mesh_by_device_id(axis_shapes, axis_names, devices)


def memory_of_live_arrays(original, devices):
    """hbm_usage_bytes: the live arrays' bytes per device, beside the host's RAM."""
    return off_tpu.memory_in_use(devices)


def kv_cache_budget_of_the_host(original, self):
    """TPUWorker.determine_available_memory: the budget from the host's memory, said."""
    return off_tpu.worker_kv_cache_budget(self)


def memory_of_the_host(original, cls):
    """TpuPlatform.mem_get_info: the host's available and total memory."""
    return off_tpu.host_memory()


def device_name_of_the_host(original, cls, device_id=0):
    """TpuPlatform.get_device_name: the JAX platform ("CPU"), not a TPU's name."""
    return host_platform().upper()


def no_compiler_options(original):
    """get_step_fn_compiler_options, get_sampling_compiler_options: none."""
    return {}


def device_put_of_copies(original, tensor, sharding, *, layout=None, source_mesh=None):
    """general_device_put: host arrays copied before the step reads them (off_tpu)."""
    return off_tpu.put_for_the_step(original, tensor, sharding, layout, source_mesh)


def portable_attention(original, self, *args, **kwargs):
    """RPAAttentionBackend.attention: the portable kernel, unless TPU_MODELS_ATTENTION
    asks for the RPA backend as on a TPU (adapt.rpa_kernel)."""
    if attention_mode() != "portable":
        return original(self, *args, **kwargs)
    from tpu_models.attention import PortableAttentionBackend
    return PortableAttentionBackend().attention(*args, **kwargs)


def portable_kv_cache_shape(original, self, *args):
    """RPAAttentionBackend.get_kv_cache_shape: the portable kernel's cache, as above."""
    if attention_mode() != "portable":
        return original(self, *args)
    from tpu_models.attention import PortableAttentionBackend
    return PortableAttentionBackend().get_kv_cache_shape(*args)


def _patch(name, targets, why, test, install=None, speed=""):
    return Patch(name, OFF_TPU_HOST, tuple(Target(*t) for t in targets), why, test, install,
                 platform=OFF_TPU, speed=speed)


UTILS = "tpu_inference.utils"
PLATFORM = "tpu_inference.platforms.tpu_platform.TpuPlatform"
OPTIONS = "tpu_inference.models.common.compiler_options"
BACKEND = "tpu_inference.layers.common.attention_backend.RPAAttentionBackend"
E2E = "tests/test_serve_e2e.py::test_concurrent_greedy_matches_transformers"
PATCHES = [
    _patch("mesh without device coords", [(f"{UTILS}.make_optimized_mesh",
                                            "axis_shapes axis_names devices", mesh_by_device_id)],
           "the mesh sorts devices by .coords, which only TPU devices have",
           "tests/test_tensor_parallel.py::test_greedy_tokens_equal_across_tensor_parallel_sizes"),
    _patch("memory sized from the host", [
        (f"{UTILS}.hbm_usage_bytes", "devices", memory_of_live_arrays),
        ("tpu_inference.worker.tpu_worker.TPUWorker.determine_available_memory", "self",
         kv_cache_budget_of_the_host),
        (f"{PLATFORM}.mem_get_info", "", memory_of_the_host),
        (f"{PLATFORM}.get_device_name", "device_id", device_name_of_the_host)],
        "memory sizing asks for TPU HBM and raises 'Expected TPU devices'", E2E),
    _patch("no xla_tpu_* compiler options", [
        (f"{OPTIONS}.get_step_fn_compiler_options", "", no_compiler_options),
        (f"{OPTIONS}.get_sampling_compiler_options", "", no_compiler_options),
        ("tpu_inference.layers.jax.sample.sampling.sample",
         "rng mesh logits tpu_sampling_metadata allow_distributed_sampling")],
        "XLA off-TPU refuses the xla_tpu_* options baked into jitted functions", E2E,
        off_tpu.sampler_without_tpu_options),
    _patch("host inputs copied before the step", [
        ("tpu_inference.layers.common.utils.general_device_put",
         "tensor sharding layout source_mesh", device_put_of_copies)],
        "on CPU the step could read host buffers the runner refills for the next step",
        "tests/test_adapt.py::test_host_inputs_reach_the_device_as_device_put_places_them_and_as_"
        "copies"),
    _patch("portable kernel for tpu-inference's models", [
        (f"{BACKEND}.attention", "self args kwargs", portable_attention),
        (f"{BACKEND}.get_kv_cache_shape",
         "self total_num_pages page_size num_kv_heads head_dim kv_dtype", portable_kv_cache_shape)],
        "tpu-inference's own models hard-code the Pallas TPU kernel (RPA v3)",
        "tests/test_serve_e2e.py::test_builtin_qwen3_through_the_same_portability_layer"),
    _patch("argmax as two reductions", [
        ("jax.interpreters.mlir.register_lowering", "prim rule platform inline cacheable")],
        "XLA:CPU's argmax, a scalar loop: 1 ms a greedy token over a 262k vocabulary",
        "tests/test_adapt.py::test_argmax_off_tpu_answers_as_numpy",
        off_tpu.argmax_as_two_reductions,
        speed="tpu-models bench step"),
    _patch("token buckets from 1", [], "a lone decode paid for 16 padded rows of matmuls", E2E,
           off_tpu.small_token_buckets, speed="tpu-models bench step"),
]
