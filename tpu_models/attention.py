"""Ragged paged attention in plain JAX: the attention of hosts without a TPU.

It reads and writes the KV cache exactly as tpu-inference's RPA v3 kernel lays
it out, so the engine allocates, swaps and prefix-shares pages unchanged:

    kv_cache: [num_pages, page_size, align(2 * K, packing) / packing, packing,
               align(head_dim, 128)]

where the flattened (slot, packing) axis interleaves heads as k0, v0, k1, v1...
and `packing` is how many cache elements fit in 32 bits (1 fp32, 2 bf16, 4 fp8).

A step's batch is ragged: request r owns query rows cu_q_lens[r]:cu_q_lens[r+1]
and, after this step, seq_lens[r] tokens of context. Requests with one query
token (decode) are attended a block of requests at a time; longer ones (prefill,
chunked prefill) a block of their own queries at a time. Either way keys are
visited a block of pages at a time with an online softmax, so memory stays
bounded by the block sizes, never by queries x context.

Shapes: T tokens, N query heads, K kv heads, G = N / K, H head_dim, R requests,
S page size, B pages per key block.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from tpu_inference.layers.common.attention_backend import AttentionBackend
from tpu_inference.layers.common.sharding import ShardingAxisName
from tpu_inference.utils import get_mesh_shape_product

_MASKED = -1e30  # finite: a fully masked block must not turn the softmax into NaN


# Requests of at most this many queries attend through the decode path, a row per
# query, all at once: the prefill path takes requests one after another (EAGLE-3
# verification of 4 requests x 4 queries, the demo's forward: 3.8 -> 2.4 ms).
SHORT_QUERIES = 8


def cache_packing(dtype) -> int:
    return max(1, 4 // jnp.dtype(dtype).itemsize)


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int,
                   head_dim: int, dtype) -> tuple[int, ...]:
    packing = cache_packing(dtype)
    slots = -(-2 * num_kv_heads // packing)
    return (num_pages, page_size, slots, packing, -(-head_dim // 128) * 128)


def _pack_kv(k, v, kv_cache):
    """k, v [T, K, H] -> cache rows [T, slots, packing, Hp].

    As with RPA, callers hand in k / k_scale and v / v_scale already quantized.
    """
    _, _, slots, packing, padded_dim = kv_cache.shape
    kv = jnp.stack([k, v], axis=2)  # [T, K, 2, H]
    tokens, kv_heads, _, head_dim = kv.shape
    kv = kv.reshape(tokens, 2 * kv_heads, head_dim)
    kv = jnp.pad(kv, ((0, 0), (0, slots * packing - 2 * kv_heads),
                      (0, padded_dim - head_dim)))
    return kv.reshape(tokens, slots, packing, padded_dim).astype(kv_cache.dtype)


def _unpack_kv(rows, kv_heads, head_dim, k_scale, v_scale):
    """cache rows [..., slots, packing, H] (as _gather_pages copies them) -> k, v
    [..., K, H] in fp32."""
    rows = rows.reshape(*rows.shape[:-3], -1, rows.shape[-1])
    rows = rows[..., :2 * kv_heads, :].astype(jnp.float32)
    rows = rows.reshape(*rows.shape[:-2], kv_heads, 2, head_dim)
    k, v = rows[..., 0, :], rows[..., 1, :]
    if k_scale is not None:
        k, v = k * k_scale, v * v_scale
    return k, v


def _online_softmax_step(carry, scores, values, mask, weigh_values):
    """One key block of flash attention; scores hold the block's keys on the last
    axis, mask broadcasts to them; weigh_values(p, values) sums p x values over the keys."""
    m, l, acc = carry
    scores = jnp.where(mask, scores, _MASKED)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
    correction = jnp.exp(m - m_new)
    l = l * correction + p.sum(axis=-1)
    acc = acc * correction[..., None] + weigh_values(p, values)
    return m_new, l, acc


def _attend_key_blocks(key_step, first, last, rows, head_dim):
    """Runs key_step over key blocks [first, last) from an empty softmax whose
    state has shape `rows` (an entry per query and head) -> attention [*rows, H] in fp32."""
    init = (jnp.full(rows, _MASKED, jnp.float32), jnp.zeros(rows, jnp.float32),
            jnp.zeros((*rows, head_dim), jnp.float32))
    _, l, acc = lax.fori_loop(first, last, key_step, init)
    return acc / jnp.maximum(l, 1e-30)[..., None]  # a fully masked row stays 0


class _PagedKV(NamedTuple):
    """The KV cache and the page tables that index it, as attention reads them."""
    kv_cache: jax.Array  # [num_pages, S, slots, packing, Hp]
    block_tables: jax.Array  # [R, pages_per_seq]
    kv_heads: int
    head_dim: int
    k_scale: float | None
    v_scale: float | None


def _gather_pages(cache, page_ids, head_dim):
    """cache[page_ids][..., :head_dim] -> [..., S, slots, packing, H], copying only
    the head_dim columns: the cache pads them to 128 (4x the demo's 32)."""
    batch = page_ids.ndim
    dims = lax.GatherDimensionNumbers(offset_dims=tuple(range(batch, batch + 4)),
                                      collapsed_slice_dims=(0, ), start_index_map=(0, ))
    return lax.gather(cache, page_ids[..., None], dims, (1, *cache.shape[1:-1], head_dim),
                      mode=lax.GatherScatterMode.CLIP)


def _gather_keys(paged, seq_rows, first_page, block_idx, pages):
    """Key block `block_idx` (`pages` pages) from each request's `first_page` on,
    of the requests seq_rows -> k, v [..., S*B, K, H]."""
    cache, tables = paged.kv_cache, paged.block_tables
    cols = jnp.asarray(first_page)[..., None] + block_idx * pages + jnp.arange(pages)
    cols = jnp.clip(cols, 0, tables.shape[1] - 1)
    page_ids = jnp.take_along_axis(tables[seq_rows], cols, axis=-1)  # [..., B]
    rows = _gather_pages(cache, page_ids, paged.head_dim)  # [..., B, S, slots, packing, H]
    rows = rows.reshape(*rows.shape[:-5], pages * cache.shape[1], *rows.shape[-3:])
    return _unpack_kv(rows, paged.kv_heads, paged.head_dim, paged.k_scale, paged.v_scale)


def _scale_scores(scores, sm_scale, soft_cap):
    scores = scores * sm_scale
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


# Jitted so that every layer of a model, calling it with the same shapes and
# settings, reuses one trace and one lowering: tracing it per layer made up most
# of each precompiled bucket's start-up cost (26 layers for Gemma 3 1B).
@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "k_scale", "v_scale", "update_kv_cache",
    "q_block", "kv_block", "decode_block", "decode_kv_block", "decode_block_bytes"))
def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    kv_cache: jax.Array,  # [num_pages, S, slots, packing, Hp]
    seq_lens: jax.Array,  # [R] context length after this step
    block_tables: jax.Array,  # [R * pages_per_seq]
    cu_q_lens: jax.Array,  # [R + 1]
    num_seqs: jax.Array,  # [] live requests
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    update_kv_cache: bool = True,
    q_block: int = 64,
    kv_block: int = 256,
    decode_block: int = 16,
    decode_kv_block: int = 64,
    decode_block_bytes: int = 4 << 20,
) -> tuple[jax.Array, jax.Array]:
    """Returns (out [T, N, H] in q.dtype, updated kv_cache)."""
    num_tokens = q.shape[0]
    max_seqs = seq_lens.shape[0]
    # A step of few tokens (speculative verification, a draft's first pass, a
    # short prompt) has no request of q_block queries: smaller blocks skip the
    # padding rows (4 queries: 0.47 -> 0.18 ms a layer on the demo's shapes).
    q_block = min(q_block, 1 << (num_tokens - 1).bit_length())
    block_tables = block_tables.reshape(max_seqs, block_tables.shape[0] // max_seqs)
    cu_q_lens = cu_q_lens[:max_seqs + 1]
    live = jnp.arange(max_seqs) < num_seqs
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)

    seq_of, position, valid = _token_requests(cu_q_lens, seq_lens, num_seqs, live, num_tokens)
    if update_kv_cache:
        kv_cache = _write_kv(kv_cache, k, v, block_tables, seq_of, position, valid)

    paged = _PagedKV(kv_cache, block_tables, k.shape[1], q.shape[2], k_scale, v_scale)
    scale = functools.partial(_scale_scores, sm_scale=sm_scale, soft_cap=soft_cap)
    # q_block spare rows: prefill writes whole query blocks.
    out = jnp.zeros((num_tokens + q_block, *q.shape[1:]), q.dtype)
    out = _decode(out, q, paged, q_lens, seq_of, position, valid, scale=scale,
                  sliding_window=sliding_window, block=decode_block,
                  kv_block=decode_kv_block, block_bytes=decode_block_bytes)
    out = _prefill(out, q, paged, seq_lens, cu_q_lens, q_lens, scale=scale,
                   sliding_window=sliding_window, q_block=q_block, kv_block=kv_block)
    return out[:num_tokens], kv_cache


def write_kv_cache(kv_cache, k, v, seq_lens, block_tables, cu_q_lens, num_seqs):
    """A step's keys and values [T, K, H] written as ragged_paged_attention writes them."""
    max_seqs = seq_lens.shape[0]
    seq, pos, valid = _token_requests(cu_q_lens[:max_seqs + 1], seq_lens, num_seqs,
                                      jnp.arange(max_seqs) < num_seqs, k.shape[0])
    return _write_kv(kv_cache, k, v, block_tables.reshape(max_seqs, -1), seq, pos, valid)


def _token_requests(cu_q_lens, seq_lens, num_seqs, live, num_tokens):
    """Each token row's request, its position in it, and whether it is a live
    request's (padding rows: the last request's, not valid)."""
    token = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], token, side="right"), seq_lens.shape[0] - 1)
    valid = (token < cu_q_lens[num_seqs]) & live[seq]
    return seq, seq_lens[seq] - (cu_q_lens[seq + 1] - token), valid


def _write_kv(kv_cache, k, v, block_tables, seq, pos, valid):
    """Writes this step's keys and values [T, K, H] into their pages; padding tokens are dropped."""
    num_pages, page_size = kv_cache.shape[:2]
    page = block_tables[seq, jnp.clip(pos // page_size, 0, block_tables.shape[1] - 1)]
    page = jnp.where(valid, page, num_pages)  # out of range: dropped
    return kv_cache.at[page, pos % page_size].set(_pack_kv(k, v, kv_cache), mode="drop")


def _decode(out, q, paged, q_lens, seq_of, position, valid, *, scale, sliding_window,
            block, kv_block, block_bytes):
    """Attends the queries of short requests (decodes, speculative verification),
    one row per query, `block` rows at a time, into their rows of out.

    A decode reads far more keys than it computes on: what costs is the page
    gather's copy, so a row block's key block stays within `block_bytes` (past
    the host's cache it slows 2-4x) and is copied once, heads ahead of keys:
    both products are batched matmuls over (row, kv head). A block copies keys
    for all its rows, live or not, so few rows go in smaller blocks. A short
    request's queries are rows of their own, each up to its position: batched,
    where the prefill path would take the requests one after another."""
    num_tokens, _, head_dim = q.shape
    _, page_size, *slot_shape = paged.kv_cache.shape
    pages = max(1, kv_block // page_size)
    # One key's copy: all its slots, head_dim wide.
    key_bytes = math.prod(slot_shape[:-1]) * head_dim * paged.kv_cache.dtype.itemsize
    block = max(1, min(block, num_tokens, block_bytes // (pages * page_size * key_bytes)))
    is_row = valid & (q_lens[seq_of] <= SHORT_QUERIES)
    num_decode = is_row.sum()
    decode_ids = jnp.nonzero(is_row, size=num_tokens, fill_value=num_tokens)[0]
    decode_ids = jnp.pad(decode_ids, (0, block), constant_values=num_tokens)

    def attend(block):
        def body(i, out):
            rows = lax.dynamic_slice(decode_ids, (i * block, ), (block, ))
            return _decode_rows(out, rows, q, paged, seq_of, position, scale, sliding_window, pages)
        return lambda out: lax.fori_loop(0, -(-num_decode // block), body, out)

    sizes = sorted({1, min(4, block), block})  # the smallest that holds every decode
    branch = sum((num_decode > size).astype(jnp.int32) for size in sizes[:-1])
    return lax.switch(branch, [attend(size) for size in sizes], out)


def _decode_rows(out, rows, q, paged, seq_of, position, scale, sliding_window, pages):
    """Attends the query rows `rows` (num_tokens where unused), each up to its own
    position, into their rows of out: their keys a block of `pages` pages at a time."""
    num_tokens, num_heads, head_dim = q.shape
    block, kv_heads, page_size = rows.shape[0], paged.kv_heads, paged.kv_cache.shape[1]
    group, block_keys = num_heads // kv_heads, pages * page_size
    heads_first = (((3, ), (3, )), ((0, 1), (0, 1)))  # [D, K, G, H] x [D, K, keys, H]
    keys_summed = (((3, ), (2, )), ((0, 1), (0, 1)))  # [D, K, G, keys] x [D, K, keys, H]
    valid, rows = rows < num_tokens, jnp.minimum(rows, num_tokens - 1)
    ids = seq_of[rows]  # each row's request
    hi = jnp.where(valid, position[rows] + 1, 0)  # keys [lo, hi): to its own position
    lo = jnp.maximum(hi - sliding_window, 0) if sliding_window else jnp.zeros_like(hi)
    # Each request reads from the page holding its window's first key: the
    # pages before it may already be back in the pool (hybrid KV cache).
    first_page = lo // page_size
    qb = q[rows].reshape(block, kv_heads, group, head_dim).astype(jnp.float32)

    def key_step(c, carry):
        keys, values = _gather_keys(paged, ids, first_page, c, pages)  # [D, S*B, K, H]
        keys, values = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
        s = scale(lax.dot_general(qb, keys, heads_first))  # [D, K, G, S*B]
        pos = (first_page * page_size)[:, None] + c * block_keys + jnp.arange(block_keys)
        mask = ((pos >= lo[:, None]) & (pos < hi[:, None]))[:, None, None, :]
        return _online_softmax_step(  # carry: [D, K, G], [D, K, G], [D, K, G, H]
            carry, s, values, mask, lambda p, vals: lax.dot_general(p, vals, keys_summed))

    steps = -(-(hi - first_page * page_size) // block_keys)
    o = _attend_key_blocks(key_step, 0, jnp.where(valid, steps, 0).max(),
                           (block, kv_heads, group), head_dim)  # [D, K, G, H]
    o = o.reshape(block, num_heads, head_dim)
    return out.at[jnp.where(valid, rows, out.shape[0])].set(o.astype(q.dtype), mode="drop")


def _prefill(out, q, paged, seq_lens, cu_q_lens, q_lens, *, scale, sliding_window, q_block,
             kv_block):
    """Attends the requests of more than SHORT_QUERIES queries, `q_block` queries of
    one request at a time, into their rows of out."""
    num_heads, head_dim = q.shape[1:]
    kv_heads = paged.kv_heads
    group = num_heads // kv_heads
    page_size = paged.kv_cache.shape[1]
    pages = max(1, kv_block // page_size)
    block_keys = pages * page_size
    key_offsets = jnp.arange(block_keys)
    is_prefill = q_lens > SHORT_QUERIES
    prefill_ids = jnp.nonzero(is_prefill, size=q_lens.shape[0], fill_value=0)[0]
    q_padded = jnp.pad(q, ((0, q_block), (0, 0), (0, 0)))
    query_offsets = jnp.arange(q_block)

    def request(i, out):
        r = prefill_ids[i]
        q_len, kv_len = q_lens[r], seq_lens[r]
        context = kv_len - q_len

        def query_block(b, out):
            row0 = cu_q_lens[r] + b * q_block
            qb = lax.dynamic_slice(q_padded, (row0, 0, 0), (q_block, num_heads, head_dim))
            qb = qb.reshape(q_block, kv_heads, group, head_dim).astype(jnp.float32)
            q_pos = context + b * q_block + query_offsets  # [Q]
            q_valid = b * q_block + query_offsets < q_len
            hi = jnp.minimum(context + (b + 1) * q_block, kv_len)
            lo = jnp.maximum(context + b * q_block - sliding_window + 1, 0) if sliding_window else 0
            first_page = lo // page_size  # pages before the window are never read

            def key_step(c, carry):
                keys, values = _gather_keys(paged, r, first_page, c, pages)  # [S*B, K, H]
                s = scale(jnp.einsum("qkgh,skh->kgqs", qb, keys,
                                     preferred_element_type=jnp.float32))  # [K, G, Q, S*B]
                k_pos = first_page * page_size + c * block_keys + key_offsets
                mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_len)
                if sliding_window:
                    mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
                return _online_softmax_step(  # carry: [K, G, Q], [K, G, Q], [K, G, Q, H]
                    carry, s, values, mask[None, None],
                    lambda p, vals: jnp.einsum("kgqs,skh->kgqh", p, vals))

            o = _attend_key_blocks(key_step, 0, -(-(hi - first_page * page_size) // block_keys),
                                   (kv_heads, group, q_block), head_dim)  # [K, G, Q, H]
            o = o.transpose(2, 0, 1, 3).reshape(q_block, num_heads, head_dim).astype(q.dtype)
            old = lax.dynamic_slice(out, (row0, 0, 0), o.shape)
            return lax.dynamic_update_slice(
                out, jnp.where(q_valid[:, None, None], o, old), (row0, 0, 0))

        return lax.fori_loop(0, -(-q_len // q_block), query_block, out)

    return lax.fori_loop(0, is_prefill.sum(), request, out)


class PortableAttentionBackend(AttentionBackend):
    """tpu-inference attention backend running `ragged_paged_attention` above.

    Selected with `--attention-backend portable`; the host portability layer
    also routes tpu-inference's default (RPA) attention here off-TPU.
    """

    name = "portable"

    def get_kv_cache_shape(self, total_num_pages, page_size, num_kv_heads,
                           head_dim, kv_dtype):
        return kv_cache_shape(total_num_pages, page_size, num_kv_heads, head_dim,
                              kv_dtype)

    def attention(self, kv_cache, q, k, v, md, shared_md, mesh, *,
                  head_dim_original, sm_scale, attention_chunk_size, q_scale,
                  k_scale, v_scale, sinks, update_kv_cache, use_causal_mask,
                  attn_logits_soft_cap, decode_query_size):
        del head_dim_original, decode_query_size  # padded dims are zeros; no kernel tuning here
        if sinks is not None:
            raise NotImplementedError("portable attention: attention sinks are not supported")
        if not use_causal_mask:
            raise NotImplementedError("portable attention: only causal attention is supported")
        if q_scale is not None:
            raise NotImplementedError("portable attention: quantized queries are not supported")
        return sharded_attention(
            mesh, q, k, v, kv_cache, shared_md.seq_lens, md.block_tables,
            shared_md.query_start_loc, shared_md.request_distribution[2],
            sm_scale=sm_scale, sliding_window=attention_chunk_size,
            soft_cap=attn_logits_soft_cap, k_scale=k_scale, v_scale=v_scale,
            update_kv_cache=update_kv_cache)


def sharded_attention(mesh, q, k, v, kv_cache, seq_lens, block_tables,
                      cu_q_lens, num_seqs, **kwargs):
    """Runs ragged_paged_attention per tensor-parallel shard of the heads ->
    (kv_cache, out), in the order tpu-inference's attention returns them."""
    tp = get_mesh_shape_product(mesh, ShardingAxisName.ATTN_HEAD)
    if tp > 1 and k.shape[1] < tp:
        # Fewer KV heads than shards: each shard keeps a copy of its KV head,
        # as the engine sized the cache for (see get_kv_cache_shape_with_mesh).
        if tp % k.shape[1]:
            raise ValueError(f"tensor parallel size {tp} is not a multiple of "
                             f"the {k.shape[1]} KV heads")
        copies = tp // k.shape[1]
        k, v = jnp.repeat(k, copies, axis=1), jnp.repeat(v, copies, axis=1)

    heads = P(None, ShardingAxisName.ATTN_HEAD, None)
    cache = P(None, None, ShardingAxisName.ATTN_HEAD, None, None)
    fn = functools.partial(ragged_paged_attention, **kwargs)
    out, kv_cache = jax.shard_map(
        lambda q, k, v, c, *md: fn(q, k, v, c, *md),
        mesh=mesh,
        in_specs=(heads, heads, heads, cache, P(), P(), P(), P()),
        out_specs=(heads, cache),
        check_vma=False,
    )(q, k, v, kv_cache, seq_lens, block_tables, cu_q_lens, num_seqs)
    return kv_cache, out
