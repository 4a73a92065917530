"""The RPA v3 kernel: tpu-inference's TPU attention path, run off-TPU.

On a TPU our models call tpu-inference's RPA backend: its KV-cache layout, its
shard_map over heads, and the Pallas kernel (`ragged_paged_attention`, or its
head_dim-64 twin). Off-TPU they call the portable kernel, unless
TPU_MODELS_ATTENTION asks for the TPU path: then everything around the kernel
is what a TPU runs, and the kernel is
- rpa-interpret: the Pallas kernel itself, in JAX's TPU interpreter
  (adapt/rpa_interpret.py): its block sizes, DMAs and double buffering too;
- rpa-reference: tpu-inference's own reference of it
  (`ref_ragged_paged_attention`), called on the host through `jax.pure_callback`.
  The reference checks its inputs as the kernel's contract states them and
  loops over requests in Python: it exercises the cache layout, the arguments
  our layers pass and the kernel's semantics, not block sizes, VMEM or chunking.
"""

from tpu_models.adapt.guard import OFF_TPU, RPA_PATH, Patch, Target

INTERFACE = "tpu_inference.layers.common.attention_interface"
KERNELS = "tpu_inference.kernels.ragged_paged_attention.v3"


def by_reference(reference):
    """A kernel with the Pallas kernel's signature that runs `reference` on the host."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def on_host(options, queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
                distribution):
        # The reference writes each request's pages back with a scatter into the whole
        # cache, eagerly: a copy of the cache per request and layer. It is given the
        # pages the live requests read instead (gathered, page numbers renamed, their
        # count padded to a power of two so the scatters compile a few shapes), and
        # they are put back after. Nothing else is read or written.
        pages_per_seq = page_indices.shape[0] // kv_lens.shape[0]
        page_size = kv_cache.shape[1]
        spans = [slice(i * pages_per_seq, i * pages_per_seq + -(-int(kv_lens[i]) // page_size))
                 for i in range(int(distribution[-1]))]
        used = np.unique(np.concatenate([page_indices[s] for s in spans] + [np.zeros(0, np.int32)]))
        pages = np.zeros((1 << max(len(used) - 1, 0).bit_length(),) + kv_cache.shape[1:],
                         kv_cache.dtype)
        pages[:len(used)] = kv_cache[used]
        renamed = np.zeros_like(page_indices)
        for s in spans:
            renamed[s] = np.searchsorted(used, page_indices[s])
        out, written = reference(*(jnp.asarray(a) for a in (
            queries, keys, values, pages, kv_lens, renamed, cu_q_lens, distribution)), **options)
        cache = np.array(kv_cache)
        cache[used] = np.asarray(written)[:len(used)]
        # The reference returns the live requests' rows only; the kernel, all of them.
        rows = np.zeros(queries.shape[:1] + out.shape[1:], out.dtype)
        rows[:out.shape[0]] = np.asarray(out)
        return rows, cache

    def kernel(queries, keys, values, kv_cache, kv_lens, page_indices, cu_q_lens,
               distribution, *sinks, sm_scale=1.0, sliding_window=None, soft_cap=None,
               q_scale=None, k_scale=None, v_scale=None, update_kv_cache=True,
               use_causal_mask=True, **tuning):  # block sizes: the reference has none
        if sinks or not update_kv_cache:
            raise NotImplementedError("TPU_MODELS_ATTENTION=rpa-reference: attention sinks "
                                      "and KV sharing have no reference here")
        options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                       q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        if not use_causal_mask:
            options["use_causal_mask"] = False
        out_dtype = jnp.float32 if queries.dtype == jnp.float32 else jnp.bfloat16
        shapes = (jax.ShapeDtypeStruct(queries.shape, out_dtype),
                  jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype))
        return jax.pure_callback(
            lambda *a: on_host(options, *a), shapes, queries, keys, values, kv_cache,
            kv_lens, page_indices, cu_q_lens, distribution)

    return kernel


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
        from tpu_models.adapt.rpa_interpret import interpreted
        interface.ragged_paged_attention = interpreted(v3, "ragged_paged_attention")
        interface.ragged_paged_attention_hd64 = interpreted(hd64, "ragged_paged_attention_hd64")
        return
    interface.ragged_paged_attention = by_reference(v3.ref_ragged_paged_attention)
    interface.ragged_paged_attention_hd64 = by_reference(hd64.ref_ragged_paged_attention_hd64)


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
