"""The RPA v3 kernel: tpu-inference's TPU attention path, run off-TPU.

What runs in the kernel's place, chosen by TPU_MODELS_ATTENTION, and the
interpreter's reads of transformed refs: tpu_models.kernels, which installs both
(`in_the_kernels_place`, `interpreted_with_transformed_refs`).
"""

from tpu_models import kernels
from tpu_models.features import RPA_INTERPRET, RPA_PATH
from tpu_models.kernels import INTERFACE, INTERPRETER
from tpu_models.patching import OFF_TPU, Patch, Target

KERNELS = "tpu_inference.kernels.ragged_paged_attention.v3"

_BATCH = "queries keys values kv_cache kv_lens page_indices cu_q_lens distribution"
_KERNEL = (f"{_BATCH} use_causal_mask update_kv_cache skip_kv_mask sm_scale sliding_window "
           "soft_cap out_dtype mask_value q_scale k_scale v_scale chunk_prefill_size "
           "d_block_sizes p_block_sizes m_block_sizes vmem_limit_bytes debug_mode "
           "disable_bounds_checks disable_semaphore_checks")
_REFERENCE = (f"{_BATCH} use_causal_mask skip_kv_mask sm_scale sliding_window soft_cap "
              "out_dtype mask_value q_scale k_scale v_scale")
_KERNEL_HD64 = (f"{_BATCH} attention_sink sm_scale sliding_window soft_cap mask_value q_scale "
                "k_scale v_scale chunk_prefill_size num_kv_pages_per_block "
                "num_queries_per_block vmem_limit_bytes debug_mode")
_REFERENCE_HD64 = (f"{_BATCH} attention_sink sm_scale sliding_window soft_cap mask_value "
                   "q_scale k_scale v_scale")
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
        kernels.interpreted_with_transformed_refs, platform=OFF_TPU),
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
        kernels.in_the_kernels_place, platform=OFF_TPU),
]
