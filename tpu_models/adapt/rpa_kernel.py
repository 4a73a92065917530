"""The RPA v3 kernel: tpu-inference's TPU attention path, run off-TPU.

On a TPU our models call tpu-inference's RPA backend: its KV-cache layout, its
shard_map over heads, and the Pallas kernel (`ragged_paged_attention`, or its
head_dim-64 twin). Off-TPU they call the portable kernel, unless
TPU_MODELS_ATTENTION asks for the TPU path: then everything around the kernel
is what a TPU runs, and the kernel is
- rpa-interpret: the Pallas kernel itself, in JAX's TPU interpreter
  (kernels.rpa_interpret, whose callbacks read the refs the kernel reshapes and
  bitcasts): its block sizes, DMAs and double buffering too;
- rpa-reference: tpu-inference's own reference of it, on the host
  (kernels.rpa_reference).
"""

from tpu_models.adapt.guard import OFF_TPU, RPA_INTERPRET, RPA_PATH, Patch, Target
from tpu_models.kernels import rpa_interpret, rpa_reference

INTERFACE = "tpu_inference.layers.common.attention_interface"
KERNELS = "tpu_inference.kernels.ragged_paged_attention.v3"
INTERPRETER = "jax._src.pallas.mosaic.interpret.interpret_pallas_call"


def transformed_refs_interpreted() -> None:
    from tpu_models.host import attention_mode
    if attention_mode() == "rpa-interpret":
        interpreter_reads_transformed_refs()


def interpreter_reads_transformed_refs() -> None:
    """Wraps the interpreter's get/store/swap (it looks them up at call time:
    `functools.partial(get, ...)` for loads and stores, `get.__wrapped__` and
    `store.__wrapped__` for DMAs), keeping its `fail_on_exception` wrapper."""
    import importlib

    import jax
    if jax.__version__ != rpa_interpret.JAX_VERSION:  # host.attention_mode refuses it first
        raise RuntimeError(f"rpa-interpret adapts JAX {rpa_interpret.JAX_VERSION}'s "
                           f"interpreter, this is {jax.__version__}")
    ipc = importlib.import_module(INTERPRETER)
    if ipc.get.__module__ == rpa_interpret.__name__:
        return
    get, store, swap = rpa_interpret.callbacks(
        ipc.get.__wrapped__, ipc.store.__wrapped__, ipc.swap.__wrapped__)
    ipc.get, ipc.store, ipc.swap = (ipc.fail_on_exception(f) for f in (get, store, swap))


def kernel_off_tpu() -> None:
    import importlib

    from tpu_models.host import attention_mode
    mode = attention_mode()
    if mode not in ("rpa-reference", "rpa-interpret"):
        return
    import jax
    # The reference (and the interpreter) dispatches JAX work of its own from inside
    # the step's callbacks. XLA:CPU admits a bounded number of programs in flight per device, and with
    # asynchronous dispatch the engine queues the next steps' programs behind the
    # one held in the callback (speculative decoding queues dozens): the reference's
    # own programs then wait for a slot forever. Run programs inline instead.
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():  # the flag is read when the client is made
        raise RuntimeError(f"TPU_MODELS_ATTENTION={mode} must be set up before JAX "
                           "opens its CPU backend")
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    interface = importlib.import_module(INTERFACE)
    v3 = importlib.import_module(f"{KERNELS}.kernel")
    hd64 = importlib.import_module(f"{KERNELS}.kernel_hd64")
    if mode == "rpa-interpret":
        interface.ragged_paged_attention = rpa_interpret.interpreted(v3, "ragged_paged_attention")
        interface.ragged_paged_attention_hd64 = rpa_interpret.interpreted(
            hd64, "ragged_paged_attention_hd64")
        return
    interface.ragged_paged_attention = rpa_reference.by_reference(v3.ref_ragged_paged_attention)
    interface.ragged_paged_attention_hd64 = rpa_reference.by_reference(
        hd64.ref_ragged_paged_attention_hd64)


_KERNEL = ("queries keys values kv_cache kv_lens page_indices cu_q_lens distribution "
           "use_causal_mask update_kv_cache skip_kv_mask sm_scale sliding_window soft_cap "
           "out_dtype mask_value q_scale k_scale v_scale chunk_prefill_size d_block_sizes "
           "p_block_sizes m_block_sizes vmem_limit_bytes debug_mode disable_bounds_checks "
           "disable_semaphore_checks")
_REFERENCE = ("queries keys values kv_cache kv_lens page_indices cu_q_lens distribution "
              "use_causal_mask skip_kv_mask sm_scale sliding_window soft_cap out_dtype "
              "mask_value q_scale k_scale v_scale")
_KERNEL_HD64 = ("queries keys values kv_cache kv_lens page_indices cu_q_lens distribution "
                "attention_sink sm_scale sliding_window soft_cap mask_value q_scale k_scale "
                "v_scale chunk_prefill_size num_kv_pages_per_block num_queries_per_block "
                "vmem_limit_bytes debug_mode")
_REFERENCE_HD64 = ("queries keys values kv_cache kv_lens page_indices cu_q_lens distribution "
                   "attention_sink sm_scale sliding_window soft_cap mask_value q_scale k_scale "
                   "v_scale")
PATCHES = [
    Patch("Pallas TPU interpreter reads reshaped and bitcast refs", RPA_INTERPRET, (
        Target(f"{INTERPRETER}.get", "token device_id local_core_id memory_space buffer_id "
               "transforms block_indices grid_loop_idx src_device_id src_local_core_id clock "
               "source_info input_name"),
        Target(f"{INTERPRETER}.store", "token device_id local_core_id memory_space buffer_id "
               "transforms val block_indices grid_loop_idx src_device_id src_local_core_id "
               "clock source_info output_name"),
        Target(f"{INTERPRETER}.swap", "token device_id local_core_id memory_space buffer_id "
               "transforms val mask source_info"),
        Target(f"{INTERPRETER}.fail_on_exception", "func"),
        Target(f"{INTERPRETER}._local_core_id_or_zero_if_hbm", "local_core_id memory_space"),
        Target(f"{INTERPRETER}._get_shared_memory", ""),
        Target("jax.experimental.pallas.tpu.force_tpu_interpret_mode", "params"),
        Target(f"{KERNELS}.kernel.get_tpu_version", ""),
        Target(f"{KERNELS}.tuned_block_sizes_hd64.get_device_name", "num_devices")),
        "RPA v3 stopped in the interpreter: 'ReshapeTransform' object has no attribute 'indices'",
        "tests/test_attention.py::test_portable_kernel_equals_the_tpu_kernel_on_random_ragged_batches",
        transformed_refs_interpreted, platform=OFF_TPU),
    Patch("RPA kernel by its reference or interpreted (TPU_MODELS_ATTENTION=rpa-reference, "
          "rpa-interpret)", RPA_PATH, (
        Target(f"{INTERFACE}.ragged_paged_attention", _KERNEL),
        Target(f"{KERNELS}.kernel.ref_ragged_paged_attention", _REFERENCE),
        Target(f"{INTERFACE}.ragged_paged_attention_hd64", _KERNEL_HD64),
        Target(f"{KERNELS}.kernel_hd64.ref_ragged_paged_attention_hd64", _REFERENCE_HD64),
        Target(f"{INTERFACE}.sharded_ragged_paged_attention",
               "mesh q k v kv_cache kv_lens page_indices cu_q_lens distribution attention_sink "
               "sm_scale attention_chunk_size q_scale k_scale v_scale update_kv_cache "
               "use_causal_mask attn_logits_soft_cap decode_query_size")),
        "the Pallas kernel compiles for TPUs only: off-TPU the TPU path could not run at all",
        "tests/test_tpu_path.py::test_both_architectures_through_the_rpa_backend_match_transformers",
        kernel_off_tpu, platform=OFF_TPU),
]
