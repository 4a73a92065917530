"""The RPA v3 Pallas kernel in JAX's TPU interpreter (TPU_MODELS_ATTENTION=rpa-interpret).

JAX's Pallas TPU interpreter simulates HBM and VMEM as numpy buffers; every ref
access (load, store, swap, both ends of a DMA) reaches one of three host
callbacks of `interpret_pallas_call` (`get`, `store`, `swap`) with the ref's
transforms, which `interpret_utils.to_range` turns into one index range. That
assumes every transform is an indexer, while RPA v3 reshapes its refs (the
paged KV cache as `pages * page_size` rows) and bitcasts them (packed bf16 and
fp8 rows as uint32): on JAX 0.11.2 the first such access fails with
    AttributeError: 'ReshapeTransform' object has no attribute 'indices'
Here the three callbacks are wrapped (`callbacks`, `wrapped_callbacks`;
adapt.rpa_kernel installs them). Accesses whose transforms are all
indexers run the original callbacks unchanged. A reshape that merges leading
axes followed by an index inside one of its rows (RPA's paged DMAs) is folded
into an indexer on the unreshaped buffer. Anything else (small VMEM scratch
buffers in RPA) reads the range of the leading indexers with the original
`get`, applies the remaining reshapes, bitcasts, transposes and indexers in
numpy, and writes back through their inverses with the original `store`.
Bitcasts follow Mosaic's layout (as `pltpu.bitcast` on values): a change of
bit width packs consecutive rows of the second-minor axis, the lower row in
the lower bits.

The kernel then runs interpreted under `pltpu.force_tpu_interpret_mode`, as a
v6e would run it (its version and device name faked while it is traced, for
its block-size tables), inside the jitted model step. Limits: the interpreter
copies the whole KV cache into its simulated memory on every call (tiny caches
only), and with `detect_races` the generic path would report its whole range.
"""

import contextlib
import functools

import numpy as np

# The interpreter's callbacks are private: this is the JAX they were read in.
JAX_VERSION = "0.11.2"

# ---- numpy semantics of one ref transform, forwards and backwards ----------

def _np_index(indexer):
    """NDIndexer (its leaves already ints) -> a numpy basic index."""
    from jax._src.state import indexing
    out = []
    for idx in indexer.indices:
        if isinstance(idx, indexing.Slice):
            start, size, stride = int(idx.start), int(idx.size), int(idx.stride)
            out.append(slice(start, start + size * stride, stride))
        elif np.ndim(idx) == 0:
            out.append(int(idx))
        else:
            raise NotImplementedError(f"advanced (array) index {idx!r} on a transformed ref")
    return tuple(out)


def _check_in_bounds(index, shape, what):
    for i, (r, d) in enumerate(zip(index, shape)):
        if isinstance(r, int):
            bad = not 0 <= r < d
        else:
            n = len(range(r.start, r.stop, r.step))
            bad = r.start < 0 or (n > 0 and r.start + (n - 1) * r.step >= d)
        if bad:
            raise IndexError(f"out-of-bounds {what}: index {index} on axis {i} "
                             f"of a transformed ref view of shape {shape}")


def _bitcast(x, dtype):
    """Mosaic ref/value bitcast: bit-width changes pack the 2nd-minor axis."""
    dtype = np.dtype(dtype)
    src, dst = x.dtype.itemsize, dtype.itemsize
    if src == dst:
        return np.ascontiguousarray(x).view(dtype)
    *lead, m, n = x.shape
    if src < dst:  # pack `p` consecutive rows into one
        p = dst // src
        y = x.reshape(*lead, m // p, p, n).swapaxes(-1, -2)
        return np.ascontiguousarray(y).view(dtype)[..., 0]
    p = src // dst  # unpack every row into `p` rows
    y = np.ascontiguousarray(x).view(dtype).reshape(*lead, m, n, p)
    return np.ascontiguousarray(y.swapaxes(-1, -2)).reshape(*lead, m * p, n)


def _forward(t, x, what):
    from jax._src.state import types as st
    from jax._src.state.indexing import NDIndexer
    if isinstance(t, NDIndexer):
        index = _np_index(t)
        _check_in_bounds(index, x.shape, what)
        return x[index]
    if isinstance(t, st.ReshapeTransform):
        return x.reshape(t.shape)
    if isinstance(t, st.BitcastTransform):
        return _bitcast(x, t.dtype)
    if isinstance(t, st.TransposeTransform):
        return x.transpose(t.permutation)
    raise NotImplementedError(f"ref transform {t!r} in the Pallas TPU interpreter")


def _backward(t, parent, new_child):
    """The parent value after `new_child` is written through transform `t`."""
    from jax._src.state import types as st
    from jax._src.state.indexing import NDIndexer
    if isinstance(t, NDIndexer):
        out = parent.copy()
        out[_np_index(t)] = new_child
        return out
    if isinstance(t, st.ReshapeTransform):
        return np.ascontiguousarray(new_child).reshape(parent.shape)
    if isinstance(t, st.BitcastTransform):
        return _bitcast(new_child, parent.dtype).reshape(parent.shape)
    if isinstance(t, st.TransposeTransform):
        return new_child.transpose(np.argsort(t.permutation))
    raise NotImplementedError(f"ref transform {t!r} in the Pallas TPU interpreter")


def _split(transforms):
    """(leading indexers the original callbacks handle, the rest or ())."""
    from jax._src.state.indexing import NDIndexer
    transforms = tuple(transforms)
    for i, t in enumerate(transforms):
        if not isinstance(t, NDIndexer):
            return transforms[:i], transforms[i:]
    return transforms, ()


# Fast path. RPA's paged DMAs address the HBM KV cache as
# `cache.reshape(pages * page_size, ...).at[pl.ds(page * page_size + off, n)]`,
# a window inside one page. Run through the generic path, every such DMA would
# read (and, for the cache update, write back) the whole cache. A reshape that
# merges leading axes, followed by an indexer whose first index stays inside one
# row of the merged axes, is the same as an indexer on the unreshaped ref, which
# the original callbacks handle in place; `_plan` rewrites such pairs.

def _index_shape(indexer):
    from jax._src.state import indexing
    return tuple(int(i.size) for i in indexer.indices if isinstance(i, indexing.Slice))


def _fold_pair(shape, reshape, indexer):
    """`reshape` then `indexer` on a ref of `shape` as one NDIndexer, or None."""
    from jax._src.state import indexing
    new = tuple(reshape.shape)
    j = len(shape) - len(new) + 1  # leading axes merged into new axis 0
    if j < 1 or tuple(shape[j:]) != new[1:] or int(np.prod(shape[:j])) != new[0]:
        return None
    first, rest = indexer.indices[0], tuple(indexer.indices[1:])
    if isinstance(first, indexing.Slice):
        start, size, stride = int(first.start), int(first.size), int(first.stride)
        last = start + max(size - 1, 0) * stride
        if not 0 <= start <= last < new[0] or start // shape[j - 1] != last // shape[j - 1]:
            return None
        outer = np.unravel_index(start // shape[j - 1], shape[:j - 1]) if j > 1 else ()
        lead = (*map(int, outer), indexing.Slice(start % shape[j - 1], size, stride))
    else:
        if not 0 <= int(first) < new[0]:
            return None
        lead = tuple(map(int, np.unravel_index(int(first), shape[:j])))
    return indexing.NDIndexer(lead + rest, tuple(shape), ())


def _buffer_shape(device_id, local_core_id, memory_space, buffer_id):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    space = ipc.TPU_MEMORY_SPACE_NAMES[int(memory_space)]
    key = (space, int(buffer_id), int(device_id),
           ipc._local_core_id_or_zero_if_hbm(int(local_core_id), space))
    return tuple(ipc._get_shared_memory().mem[key].logical_shape)


def _plan(transforms, device_id, local_core_id, memory_space, buffer_id):
    """(indexers for the original callbacks, transforms left for numpy)."""
    from jax._src.state import types as st
    from jax._src.state.indexing import NDIndexer
    head, chain = _split(transforms)
    while (len(chain) >= 2 and isinstance(chain[0], st.ReshapeTransform)
           and isinstance(chain[1], NDIndexer)):
        shape = (_index_shape(head[-1]) if head else
                 _buffer_shape(device_id, local_core_id, memory_space, buffer_id))
        folded = _fold_pair(shape, chain[0], chain[1])
        if folded is None:
            break
        more, chain = _split(chain[2:])
        head = (*head, folded, *more)
    return head, chain


def _views(base, chain, what):
    views = [base]
    for t in chain:
        views.append(_forward(t, views[-1], what))
    return views


def _write_back(views, chain, value):
    new = np.asarray(value, dtype=views[-1].dtype).reshape(views[-1].shape)
    for t, parent in zip(reversed(chain), reversed(views[:-1])):
        new = _backward(t, parent, new)
    return new


# ---- the wrapped interpreter callbacks --------------------------------------

def _make_get(orig):
    def get(token, device_id, local_core_id, memory_space, buffer_id, transforms,
            *args, **kwargs):
        head, chain = _plan(transforms, device_id, local_core_id, memory_space, buffer_id)
        if not chain:
            return orig(token, device_id, local_core_id, memory_space, buffer_id,
                        head, *args, **kwargs)
        token, base = orig(token, device_id, local_core_id, memory_space, buffer_id,
                           head, *args, **kwargs)
        return token, np.array(_views(base, chain, "read")[-1])
    return get


def _make_store(orig_get, orig_store):
    def store(token, device_id, local_core_id, memory_space, buffer_id, transforms,
              val, block_indices=None, grid_loop_idx=None, *, src_device_id=None,
              src_local_core_id=None, clock=None, source_info=None, output_name=None):
        head, chain = _plan(transforms, device_id, local_core_id, memory_space, buffer_id)
        kw = dict(src_device_id=src_device_id, src_local_core_id=src_local_core_id,
                  clock=clock, source_info=source_info)
        if not chain:
            return orig_store(token, device_id, local_core_id, memory_space, buffer_id,
                              head, val, block_indices, grid_loop_idx,
                              output_name=output_name, **kw)
        _, base = orig_get(token, device_id, local_core_id, memory_space, buffer_id,
                           head, **kw)
        views = _views(np.asarray(base), chain, "write")
        new_base = _write_back(views, chain, val)
        return orig_store(token, device_id, local_core_id, memory_space, buffer_id,
                          head, new_base, block_indices, grid_loop_idx,
                          output_name=output_name, **kw)
    return store


def _make_swap(orig_get, orig_store, orig_swap):
    def swap(token, device_id, local_core_id, memory_space, buffer_id, transforms,
             val, mask, *, source_info=None):
        head, chain = _plan(transforms, device_id, local_core_id, memory_space, buffer_id)
        if not chain:
            return orig_swap(token, device_id, local_core_id, memory_space, buffer_id,
                             head, val, mask, source_info=source_info)
        _, base = orig_get(token, device_id, local_core_id, memory_space, buffer_id,
                           head, source_info=source_info)
        views = _views(np.asarray(base), chain, "swap")
        old = np.array(views[-1])
        new = np.asarray(val, dtype=old.dtype)
        if mask is not None:
            new = np.where(np.asarray(mask), new, old)
        orig_store(token, device_id, local_core_id, memory_space, buffer_id, head,
                   _write_back(views, chain, new), source_info=source_info)
        return token, old
    return swap


# What the kernels ask a TPU for: its version (kernel.py: block sizes, and the
# mask path of v6 and later), its name (kernel_hd64's tuned block sizes), its
# VMEM size (vmem_limit_bytes=None). A v6e's answers.
FAKE_TPU_VERSION, FAKE_DEVICE_NAME, FAKE_VMEM_BYTES = 6, "TPU v6e", 128 << 20


@contextlib.contextmanager
def _replaced(replacements):
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in replacements]
    for obj, name, value in replacements:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def interpreted(kernel_module, entry: str):
    """`kernel_module.entry` run in the interpreter, with the entry's signature.
    The interpret mode and the v6e's answers hold while the kernel is traced
    (the kernel's jit cache keys on the interpret mode); the result runs eagerly
    or inside jit, its batch description traced."""
    import sys

    from jax.experimental.pallas import tpu as pltpu
    kernel = getattr(kernel_module, entry)
    modules = [kernel_module]
    if hasattr(kernel_module, "get_tuned_block_sizes"):
        modules.append(sys.modules[kernel_module.get_tuned_block_sizes.__module__])
    answers = [(m, "get_tpu_version", lambda: FAKE_TPU_VERSION) for m in modules
               if hasattr(m, "get_tpu_version")]
    answers += [(m, "get_device_name", lambda *a, **k: FAKE_DEVICE_NAME) for m in modules
                if hasattr(m, "get_device_name")]

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        kwargs.setdefault("vmem_limit_bytes", FAKE_VMEM_BYTES)
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()), _replaced(answers):
            return kernel(*args, **kwargs)

    return run


def callbacks(get, store, swap):
    """The interpreter's (get, store, swap), given its originals, reading transformed
    refs."""
    return _make_get(get), _make_store(get, store), _make_swap(get, store, swap)


def wrapped_callbacks(interpreter):
    """What to put in place of the `interpreter` module's (get, store, swap): `callbacks`
    of its originals, each in the interpreter's `fail_on_exception` wrapper. It looks
    them up at call time: `functools.partial(get, ...)` for loads and stores,
    `get.__wrapped__` and `store.__wrapped__` for DMAs."""
    import jax
    if jax.__version__ != JAX_VERSION:  # host.attention_mode refuses it first
        raise RuntimeError(f"rpa-interpret adapts JAX {JAX_VERSION}'s interpreter, this is "
                           f"{jax.__version__}")
    get, store, swap = callbacks(interpreter.get.__wrapped__, interpreter.store.__wrapped__,
                                 interpreter.swap.__wrapped__)
    return tuple(interpreter.fail_on_exception(f) for f in (get, store, swap))
