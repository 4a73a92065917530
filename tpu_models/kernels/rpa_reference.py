"""tpu-inference's reference of the RPA v3 kernel (`ref_ragged_paged_attention`)
as a kernel with the Pallas kernel's signature, run on the host through
`jax.pure_callback` (TPU_MODELS_ATTENTION=rpa-reference; adapt.rpa_kernel puts
it in the kernel's place). The reference checks its inputs as the kernel's
contract states them and loops over requests in Python: it exercises the cache
layout, the arguments our layers pass and the kernel's semantics, not block
sizes, VMEM or chunking.
"""


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
