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

    programs = {}  # options -> (q_len, kv_len) -> program

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
        compiled = programs.setdefault(tuple(sorted(options.items())), {})  # once a trace
        shapes = (jax.ShapeDtypeStruct(queries.shape, out_dtype),
                  jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype))
        return jax.pure_callback(
            lambda *a: _on_host(reference, options, compiled, out_dtype, *a), shapes, queries,
            keys, values, kv_cache, kv_lens, page_indices, cu_q_lens, distribution)

    return kernel


def _one_request(reference, q_len: int, kv_len: int, options: dict, compiled: dict):
    """The reference on a batch of one request of these lengths, jitted. Run eagerly
    it compiles a dozen small programs for each (q_len, kv_len) it meets and copies
    the whole cache at each write: one program per pair, on the request's own pages,
    compiles in a fraction of the time. XLA fuses its operations: the outputs move
    by a few float32 ulps (tests/test_attention.py), the cache not at all."""
    import jax
    import numpy as np
    if (q_len, kv_len) not in compiled:
        lens, cu_lens = np.array([kv_len], np.int32), np.array([0, q_len], np.int32)
        one = np.array([0, 0, 1], np.int32)  # distribution: one live request

        def run(q, k, v, pages):
            indices = np.arange(pages.shape[0], dtype=np.int32)
            return reference(q, k, v, pages, lens, indices, cu_lens, one, **options)
        compiled[q_len, kv_len] = jax.jit(run)
    return compiled[q_len, kv_len]


def _on_host(reference, options, compiled, out_dtype, queries, keys, values, kv_cache, kv_lens,
             page_indices, cu_q_lens, distribution):
    """Each live request in turn, in the reference's order, on a batch of its own:
    its pages gathered, attended, written back before the next one reads."""
    import numpy as np
    pages_per_seq = page_indices.shape[0] // kv_lens.shape[0]
    page_size = kv_cache.shape[1]
    cache = np.array(kv_cache)
    rows = np.zeros(queries.shape, out_dtype)  # the reference returns the live rows only
    for i in range(int(distribution[-1])):
        start, end, kv_len = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lens[i])
        pages = page_indices[i * pages_per_seq:][:-(-kv_len // page_size)]
        out, written = _one_request(reference, end - start, kv_len, options, compiled)(
            queries[start:end], keys[start:end], values[start:end], cache[pages])
        cache[pages] = np.asarray(written)
        rows[start:end] = np.asarray(out)
    return rows, cache


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
