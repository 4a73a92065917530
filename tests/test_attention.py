"""Portable ragged paged attention against a dense float64 reference, and
against tpu-inference's RPA v3: its Pallas kernel in JAX's TPU interpreter
(tpu_models/kernels/rpa_interpret.py) and its own reference of that kernel.

The cache is filled by hand from the layout tpu-inference documents
(kv_cache.get_kv_cache_shape: k0, v0, k1, v1... packed per 32 bits, head_dim
padded to 128), and the new tokens' pages are checked against tpu-inference's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tpu_inference.kernels.ragged_paged_attention.v3.kernel import \
    ref_ragged_paged_attention

from tpu_models.attention import kv_cache_shape, ragged_paged_attention

PAGE = 8


def dense_reference(q, k, v, context, *, scale, window, soft_cap):
    """q [Q, N, H]; k, v [L, K, H] for the whole sequence; queries are its last Q tokens."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qnh,knh->nqk", q, k) * scale
    if soft_cap:
        s = soft_cap * np.tanh(s / soft_cap)
    q_pos = context + np.arange(q.shape[0])[:, None]
    k_pos = np.arange(k.shape[0])[None, :]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nqk,knh->qnh", p, v)


def write_cache(cache, pages, k, v):
    """Writes k, v [L, K, H] into `pages` of a numpy cache in RPA v3 layout."""
    _, _, slots, packing, _ = cache.shape
    kv_heads, head_dim = k.shape[1], k.shape[2]
    for pos in range(k.shape[0]):
        flat = cache[pages[pos // PAGE], pos % PAGE].reshape(slots * packing, -1)
        flat[0:2 * kv_heads:2, :head_dim] = k[pos]
        flat[1:2 * kv_heads:2, :head_dim] = v[pos]
        cache[pages[pos // PAGE], pos % PAGE] = flat.reshape(slots, packing, -1)


def make_batch(rng, requests, num_heads, kv_heads, head_dim, *, num_tokens,
               max_seqs=8, pages_per_seq=40, dtype=np.float32):
    """requests: (context, q_len) per request. Returns kernel inputs + per-request data."""
    num_pages = max_seqs * pages_per_seq + 1
    cache = np.zeros(kv_cache_shape(num_pages, PAGE, kv_heads, head_dim, dtype), dtype)
    page_perm = rng.permutation(num_pages - 1) + 1  # pages scattered, page 0 unused
    block_tables = np.zeros((max_seqs, pages_per_seq), np.int32)
    q = np.zeros((num_tokens, num_heads, head_dim), np.float32)
    k_new = np.zeros((num_tokens, kv_heads, head_dim), np.float32)
    v_new = np.zeros_like(k_new)
    cu, seq_lens, per_request = [0], [], []
    for r, (context, q_len) in enumerate(requests):
        block_tables[r] = page_perm[r * pages_per_seq:(r + 1) * pages_per_seq]
        k_all = rng.normal(size=(context + q_len, kv_heads, head_dim)).astype(np.float32)
        v_all = rng.normal(size=k_all.shape).astype(np.float32)
        q_r = rng.normal(size=(q_len, num_heads, head_dim)).astype(np.float32)
        write_cache(cache, block_tables[r], k_all[:context], v_all[:context])
        rows = slice(cu[-1], cu[-1] + q_len)
        q[rows], k_new[rows], v_new[rows] = q_r, k_all[context:], v_all[context:]
        cu.append(cu[-1] + q_len)
        seq_lens.append(context + q_len)
        per_request.append((rows, q_r, k_all, v_all, context))
    # Padding: garbage in the padded token rows, empty request slots.
    q[cu[-1]:] = 7.0
    k_new[cu[-1]:] = 7.0
    cu += [cu[-1]] * (max_seqs - len(requests))
    seq_lens += [0] * (max_seqs - len(requests))
    inputs = dict(q=q, k=k_new, v=v_new, kv_cache=cache,
                  seq_lens=np.array(seq_lens, np.int32),
                  block_tables=block_tables.reshape(-1),
                  cu_q_lens=np.array(cu, np.int32),
                  num_seqs=np.int32(len(requests)))
    return inputs, per_request


CASES = {
    # (context, q_len) per request: decodes first, as vLLM orders them
    "decode_only": [(5, 1), (17, 1), (64, 1), (0, 1)],
    "prefill_only": [(0, 37), (0, 5)],
    "mixed": [(30, 1), (9, 1), (0, 70), (40, 23), (3, 2)],
    "long_context_few_queries": [(250, 1), (200, 12)],
    # 8 token rows, under q_block: speculative verification's step shape
    "few_tokens": [(21, 1), (40, 2)],
    "many_decodes": [(3, 1), (20, 1), (41, 1), (0, 1), (70, 1), (9, 1), (33, 1)],
    # EAGLE-3 verification at concurrency 4: 1 + 3 drafts each, a query row apiece
    "verification": [(30, 4), (9, 4), (61, 4), (0, 4), (17, 9)],
}


# Every batch shape with plain causal attention; windows and soft-capping on the
# shapes where they bite (long contexts, chunked prefill).
VARIANTS = [(case, None, None) for case in sorted(CASES)] + [
    ("mixed", 16, None), ("mixed", None, 30.0), ("mixed", 7, 5.0),
    ("long_context_few_queries", 16, None), ("decode_only", 7, 5.0), ("few_tokens", 16, None),
    ("verification", 16, None)]


@pytest.mark.parametrize("case,window,soft_cap", VARIANTS,
                         ids=[f"{c}-w{w}-cap{s}" for c, w, s in VARIANTS])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_matches_dense_reference(case, heads, window, soft_cap, decode_block_bytes=4 << 20,
                                 decode_block=3):
    rng = np.random.default_rng(0)
    num_heads, kv_heads = heads
    head_dim = 32
    requests = CASES[case]
    total = sum(q for _, q in requests)
    inputs, per_request = make_batch(rng, requests, num_heads, kv_heads, head_dim,
                                     num_tokens=total + 5)
    scale = head_dim**-0.5
    # Small blocks so every case crosses query-block, key-block and page boundaries.
    fn = jax.jit(lambda **kw: ragged_paged_attention(
        **kw, sm_scale=scale, sliding_window=window, soft_cap=soft_cap,
        q_block=16, kv_block=16, decode_block=decode_block, decode_kv_block=16,
        decode_block_bytes=decode_block_bytes))
    out, _ = fn(**{k: jnp.asarray(v) for k, v in inputs.items()})
    out = np.asarray(out)
    for rows, q_r, k_all, v_all, context in per_request:
        want = dense_reference(q_r, k_all, v_all, context, scale=scale,
                               window=window, soft_cap=soft_cap)
        # fp32 kernel vs float64: its longest reductions (softmax and P.V over L <= 251 keys)
        # err by <= L*u = 251 * 2^-24 = 1.5e-5 relative to sum p|v|, O(1) here: 2e-5
        # (measured: 7e-7).
        np.testing.assert_allclose(out[rows], want, atol=2e-5, rtol=2e-5)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("case", ["mixed", "long_context_few_queries", "decode_only"])
@pytest.mark.parametrize("window", [7, 16, 33])
def test_pages_that_left_the_window_are_never_read(case, window):
    """The hybrid KV cache returns pages behind a local layer's window to the pool
    (vLLM then points the block table at its null page, or the page is reused):
    here they hold NaN, which any read would spread to the output."""
    rng = np.random.default_rng(1)
    num_heads, kv_heads, head_dim = 8, 2, 32
    requests = CASES[case]
    inputs, per_request = make_batch(rng, requests, num_heads, kv_heads, head_dim,
                                     num_tokens=sum(q for _, q in requests) + 5)
    inputs["kv_cache"][0] = np.nan  # page 0 is the null page
    tables = inputs["block_tables"].reshape(8, -1)
    gone = 0
    for r, (context, q_len) in enumerate(requests):
        first_key = max(context - window + 1, 0) if q_len > 1 else max(context + 1 - window, 0)
        tables[r, :first_key // PAGE] = 0
        gone += first_key // PAGE
    assert gone > 0  # the case has pages behind the window
    scale = head_dim**-0.5
    out, _ = jax.jit(lambda **kw: ragged_paged_attention(
        **kw, sm_scale=scale, sliding_window=window, q_block=16, kv_block=16, decode_block=3,
        decode_kv_block=16))(**{k: jnp.asarray(v) for k, v in inputs.items()})
    out = np.asarray(out)
    for rows, q_r, k_all, v_all, context in per_request:
        want = dense_reference(q_r, k_all, v_all, context, scale=scale, window=window,
                               soft_cap=None)
        # fp32 vs float64, <= 251 keys: L*u = 1.5e-5 on O(1) outputs, as above.
        np.testing.assert_allclose(out[rows], want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["decode_only", "mixed"])
def test_decode_block_shrinks_to_the_byte_budget(case):
    """A budget below one request's key block: decodes go one request at a time."""
    test_matches_dense_reference(case, (8, 2), 7, 5.0, decode_block_bytes=1)


@pytest.mark.parametrize("case", ["few_tokens", "decode_only", "many_decodes"])
def test_decodes_in_blocks_of_1_4_and_16_match_dense_reference(case):
    """Decodes go in the smallest block of 1, 4 or 16 requests that holds them all."""
    test_matches_dense_reference(case, (8, 2), None, None, decode_block=16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_cache_writes_match_tpu_inference_reference(dtype):
    """New tokens land in the same pages/slots as tpu-inference's reference puts them."""
    rng = np.random.default_rng(1)
    requests = [(6, 1), (0, 19), (13, 4)]
    num_heads, kv_heads, head_dim = 4, 2, 64
    total = sum(q for _, q in requests)
    inputs, _ = make_batch(rng, requests, num_heads, kv_heads, head_dim,
                           num_tokens=total, dtype=np.float32)
    inputs["kv_cache"] = inputs["kv_cache"].astype(np.float32)
    args = {k: jnp.asarray(v) for k, v in inputs.items()}
    cache = jnp.zeros(kv_cache_shape(args["kv_cache"].shape[0], PAGE, kv_heads, head_dim,
                                     dtype), dtype)
    q, k, v = (args[n].astype(dtype) for n in "qkv")
    distribution = jnp.array([1, 3, 3], jnp.int32)
    want_out, want_cache = ref_ragged_paged_attention(
        q, k, v, cache, args["seq_lens"], args["block_tables"], args["cu_q_lens"],
        distribution, sm_scale=head_dim**-0.5)
    out, got_cache = jax.jit(lambda *a: ragged_paged_attention(
        *a, sm_scale=head_dim**-0.5, q_block=8, kv_block=16))(
            q, k, v, cache, args["seq_lens"], args["block_tables"], args["cu_q_lens"],
            args["num_seqs"])
    # exact: the cache holds copies of k and v (no arithmetic)
    np.testing.assert_array_equal(np.asarray(got_cache, np.float32),
                                  np.asarray(want_cache, np.float32))
    # Only the first 3 requests' new tokens were written: compare outputs of the new-only context.
    # Two programs, different reduction orders. bf16 (8 significant bits, u = 2^-8 = 3.9e-3):
    # intermediates and the O(1) output each rounded, a few u = 2e-2 (measured: 1 ulp, 1.6e-2
    # at |x| in [2, 4)). fp32: reductions of <= 64 (head_dim) terms, 64*u = 3.8e-6 per
    # program, 1e-5 for both (measured: 6e-7).
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32),
                               atol=tol, rtol=tol)


def test_fp8_cache_round_trip_with_scales():
    """Keys and values are stored as k / k_scale in fp8 and rescaled on read."""
    rng = np.random.default_rng(2)
    requests = [(0, 9), (0, 5)]  # no prior context: every token goes through the quantized write
    num_heads, kv_heads, head_dim = 4, 2, 16
    inputs, per_request = make_batch(rng, requests, num_heads, kv_heads, head_dim, num_tokens=16)
    fp8 = jnp.float8_e4m3fn
    args = {k: jnp.asarray(v) for k, v in inputs.items()}
    args["kv_cache"] = jnp.zeros(kv_cache_shape(inputs["kv_cache"].shape[0], PAGE, kv_heads,
                                                head_dim, fp8), fp8)
    assert args["kv_cache"].shape[2:4] == (1, 4)  # 2 heads x (k, v) packed in one 32-bit slot
    # Callers quantize (tpu-inference's quantize_kv); the kernel stores and rescales.
    args["k"] = (args["k"] / 0.5).astype(fp8)
    args["v"] = (args["v"] / 0.25).astype(fp8)
    out, _ = jax.jit(lambda **kw: ragged_paged_attention(
        **kw, sm_scale=0.25, k_scale=0.5, v_scale=0.25))(**args)
    out = np.asarray(out)
    # The reference reads what the cache holds, the fp8 values times their scales (exact in
    # float64): e4m3's rounding (3 mantissa bits, up to 2^-4 relative, 0.10 here on a
    # v of 2.35) is the caller's and the same on every host; what is left is the
    # kernel's fp32 arithmetic, 2e-5 as above (measured: 3e-7).
    k_stored = np.asarray(args["k"]).astype(np.float64) * 0.5
    v_stored = np.asarray(args["v"]).astype(np.float64) * 0.25
    for rows, q_r, _, _, context in per_request:  # no prior context: k, v are the new tokens
        want = dense_reference(q_r, k_stored[rows], v_stored[rows], context, scale=0.25,
                               window=None, soft_cap=None)
        np.testing.assert_allclose(out[rows], want, atol=2e-5, rtol=2e-5)


@pytest.mark.slow  # the interpreted Pallas kernel and the eager reference, 16 batches
def test_portable_kernel_equals_the_tpu_kernel_on_random_ragged_batches():
    """16 random ragged batches (decodes first, as vLLM orders them, then prefills
    with and without context), windows, soft caps, fp32 and fp8 caches, head sizes 64,
    128 and 256: the portable kernel's outputs equal those of tpu-inference's RPA v3
    Pallas kernel (interpreted) and of its reference, and so do TPU_MODELS_ATTENTION=
    rpa-reference's (the reference a request at a time, jitted); all write the same
    cache."""
    from tpu_models import kernels
    kernels.interpreter_reads_transformed_refs()
    rng = np.random.default_rng(50)
    configs = [  # (query heads, kv heads, head_dim, window, soft cap, fp8 cache)
        (4, 2, 64, 16, 5.0, False), (8, 1, 128, 7, None, True), (4, 4, 256, None, 30.0, False),
        (4, 2, 128, 33, None, False)]
    # Lengths from a few values: the reference runs eagerly, compiling each operation
    # for each (query, context) length it meets (35 ms each).
    for trial in range(16):  # 4 batches per config: one compilation of ours each
        num_heads, kv_heads, head_dim, window, soft_cap, fp8 = configs[trial % len(configs)]
        decodes = [(int(rng.choice([24, 77, 130])), 1) for _ in range(rng.integers(0, 4))]
        prefills = [(int(rng.choice([0, 24, 77])), int(rng.choice([6, 19])))
                    for _ in range(rng.integers(0 if decodes else 1, 3))]
        requests = decodes + prefills
        tokens = sum(q for _, q in requests)
        inputs, _ = make_batch(rng, requests, num_heads, kv_heads, head_dim, num_tokens=96,
                               pages_per_seq=24)
        args = {k: jnp.asarray(v) for k, v in inputs.items()}
        scales = {}
        if fp8:  # callers quantize (tpu-inference's quantize_kv); the kernel stores and rescales
            dtype, scales = jnp.float8_e4m3fn, {"k_scale": 0.5, "v_scale": 0.25}
            args["k"] = (args["k"] / 0.5).astype(dtype)
            args["v"] = (args["v"] / 0.25).astype(dtype)
            args["kv_cache"] = jnp.zeros(kv_cache_shape(args["kv_cache"].shape[0], PAGE,
                                                        kv_heads, head_dim, dtype), dtype)
        options = dict(sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap, **scales)
        # As tpu-inference's runner describes a batch: decodes, then "mixed" (the Pallas
        # kernel launches no program for its middle, prefill-only class).
        distribution = jnp.array([len(decodes), len(decodes), len(requests)], jnp.int32)
        # Its loop over requests reads the metadata as numpy.
        want_out, want_cache = ref_ragged_paged_attention(
            args["q"], args["k"], args["v"], args["kv_cache"], inputs["seq_lens"],
            inputs["block_tables"], inputs["cu_q_lens"], np.asarray(distribution), **options)
        out, cache = _portable(**args, **options)
        tpu_out, tpu_cache = _interpreted(
            args["q"], args["k"], args["v"], args["kv_cache"], args["seq_lens"],
            args["block_tables"], args["cu_q_lens"], distribution, **options)
        where = f"trial {trial}: {requests}, heads {num_heads}/{kv_heads}x{head_dim}, " \
                f"window {window}, cap {soft_cap}, fp8 {fp8}"
        # TPU_MODELS_ATTENTION=rpa-reference: the reference run a request at a time on
        # its own pages, jitted, inside a jitted step.
        hosted_out, hosted_cache = _by_reference(
            args["q"], args["k"], args["v"], args["kv_cache"], args["seq_lens"],
            args["block_tables"], args["cu_q_lens"], distribution, **options)
        # The cache holds copies (no arithmetic): equal to the bit. The Pallas kernel
        # skips writing new tokens that are already behind the window when it skips
        # their key block; no query reads them.
        behind = _behind_the_window(inputs, requests, window)
        for name, got in (("portable", cache), ("pallas", tpu_cache),
                          ("rpa-reference", hosted_cache)):
            got, want = np.array(got, np.float32), np.array(want_cache, np.float32)
            if name == "pallas":
                got[behind], want[behind] = 0, 0
            np.testing.assert_array_equal(got, want, err_msg=f"{name} cache, {where}")
        # fp32 throughout, different reduction orders over at most ~170 keys of 256
        # products: a few hundred ulps of the O(1) outputs, 2^-23 * 512 = 6e-5. The Pallas
        # kernel and the portable one agree so with an fp8 cache too (measured: 1e-6 in
        # every batch). tpu-inference's reference does not: with an fp8 cache it rounds
        # the attention probabilities to the cache's dtype before weighing the values,
        # and the weighed sum too (its einsum of two fp8 operands is fp8), each off by up
        # to 2^-4 of itself (e4m3), the output by up to 2 * 2^-4 * max|v| (measured: up
        # to 0.21 here). The reference returns the live rows only.
        tpu_out = np.asarray(tpu_out)[:tokens]
        np.testing.assert_allclose(np.asarray(out)[:tokens], tpu_out, atol=6e-5, rtol=6e-5,
                                   err_msg=f"portable vs pallas: {where}")
        tol = 6e-5 + (2**-3 * float(jnp.abs(args["v"].astype(jnp.float32)).max()) * 0.25
                      if fp8 else 0.0)
        for name, got in (("portable", np.asarray(out)[:tokens]), ("pallas", tpu_out)):
            np.testing.assert_allclose(got, np.asarray(want_out), atol=tol, rtol=6e-5,
                                       err_msg=f"{name} vs reference: {where}")
        # The reference's own operations, fused by XLA (the soft cap's division into its
        # tanh, the softmax's subtraction into its exp): a few float32 ulps of the O(1)
        # outputs (2.4e-7 measured). With an fp8 cache such an ulp could move a
        # probability across an e4m3 rounding step (none did here).
        np.testing.assert_allclose(np.asarray(hosted_out)[:tokens], np.asarray(want_out),
                                   atol=tol if fp8 else 1e-6, rtol=0,
                                   err_msg=f"rpa-reference vs reference: {where}")


def _behind_the_window(inputs, requests, window):
    """Cache rows (page, slot) of new tokens already behind the window at the end of
    their own request."""
    mask = np.zeros(inputs["kv_cache"].shape[:2], bool)
    if window is None:
        return mask
    tables = inputs["block_tables"].reshape(len(inputs["cu_q_lens"]) - 1, -1)
    for r, (context, q_len) in enumerate(requests):
        for position in range(context, min(context + q_len, context + q_len - window)):
            mask[tables[r, position // PAGE], position % PAGE] = True
    return mask


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "k_scale", "v_scale"))
def _by_reference(*args, **kwargs):
    from tpu_models.kernels.rpa_reference import by_reference
    return by_reference(ref_ragged_paged_attention)(*args, **kwargs)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "k_scale", "v_scale"))
def _portable(**kwargs):
    return ragged_paged_attention(**kwargs, q_block=16, kv_block=32)


@functools.cache
def _pallas_kernel():
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel

    from tpu_models.kernels.rpa_interpret import interpreted
    return interpreted(kernel, "ragged_paged_attention")


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "k_scale", "v_scale"))
def _interpreted(*args, **kwargs):
    return _pallas_kernel()(*args, **kwargs)
