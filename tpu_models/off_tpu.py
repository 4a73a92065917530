"""Serving off-TPU: what a TPU answers that another JAX backend (XLA:CPU) must.

libtpu ships with tpu-inference, so vLLM picks its TPU platform on any host;
with JAX_PLATFORMS=cpu (or cuda) the engine then runs on that JAX backend until
one of its TPU-only assumptions stops it, or lets it run and return wrong tokens
(host inputs). Here is what answers them instead: a mesh of devices without TPU
coordinates (`mesh_by_device_id`); the KV cache's budget from the host's memory
(`kv_cache_budget`, said in the log by `worker_kv_cache_budget`), memory in use
from the live arrays (`memory_in_use`); host inputs copied before the step reads
them (`copied`, `put_copies`, `put_for_the_step`); the sampler jitted without
TPU compiler options (`sampler_without_tpu_options`); token buckets from 1
(`small_token_buckets`); argmax as two reductions (`first_max`); and a
weight read once from the checkpoint and rearranged and cast in one compiled
pass (`mark`, `converted_in_one_pass`, `arranged`). The seam
(adapt.host_portability, adapt.loading) puts these where tpu-inference asks a TPU.

The one pass: serving a bf16 checkpoint in float32 copied every weight three
times, our cast (runtime.in_dtype, torch), tpu-inference's transposing
`contiguous()` (torch, one thread, across cache lines) and `jnp.asarray` into
XLA's memory: 2.6 s of a 0.6B model's 3.9 s of loading on two cores. A weight
that reaches the default loader (`load_nnx_param_from_reshaped_torch`, no
quantization hook) with a served dtype marked on it (`mark`) is read once from
the checkpoint into XLA's memory in its own dtype, and rearranged and cast by one
compiled transpose (tiled, every core). Anything else takes upstream's path.
"""

import functools

# Default KV-cache budget off-TPU: a share of the host's memory, at most a share of
# what is available at start-up.
KV_CACHE_SHARE, KV_CACHE_SHARE_OF_AVAILABLE = 0.2, 0.5
# ... and under TPU_MODELS_ATTENTION=rpa-interpret: JAX's interpreter copies the whole
# cache into its simulated memory at every attention call (about 20x its size in RSS),
# so 20% of a 24 GB host (4.8 GB of cache) met the OOM killer at the first prompts.
# There the cache holds two requests at --max-model-len, and at least 32 MiB.
INTERPRETED_KV_CACHE_BYTES, INTERPRETED_REQUESTS = 32 << 20, 2


# The attribute of a checkpoint tensor that holds its served dtype (`mark`).
SERVED_DTYPE_ATTRIBUTE = "_tpu_models_served_dtype"


def mesh_by_device_id(axis_shapes, axis_names, devices=None):
    """A mesh over `devices` (else all of JAX's) in the order of their ids:
    tpu-inference's sorts them by `.coords`, which only TPU devices have."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    devices = sorted(devices if devices is not None else jax.devices(), key=lambda d: d.id)
    return Mesh(np.asarray(devices).reshape(axis_shapes), axis_names)


@functools.cache
def _arrange():
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnames=("shape", "perm", "dtype"))
    def arrange(x, shape, perm, dtype):
        x = x.reshape(shape)
        return (x if perm is None else jnp.transpose(x, perm)).astype(dtype)

    return arrange


def arranged(x, shape, perm, dtype):
    """`x` reshaped to `shape`, transposed by `perm` (None: as it is) and cast to
    `dtype` by one compiled transpose (tiled, every core)."""
    return _arrange()(x, shape=shape, perm=perm, dtype=dtype)


def kv_cache_budget(cache_config, request_bytes: int = 0) -> int:
    """Bytes for the KV cache: --kv-cache-memory-bytes, else 20% of the host's memory (at
    most half of what is available), rounded down to whole GiB (256 MiB below 1 GiB).
    The cache's size is part of every compiled step's shapes: a budget that moved with
    free memory made a restart miss the JAX cache for the whole model. Interpreted
    (rpa-interpret): two requests of `request_bytes` (one at --max-model-len), 32 MiB
    at least, in whole MiB."""
    if cache_config.kv_cache_memory_bytes:
        return int(cache_config.kv_cache_memory_bytes)
    from tpu_models.host import attention_mode
    if attention_mode() == "rpa-interpret":
        mib = -(-INTERPRETED_REQUESTS * request_bytes // 2**20)  # rounded up
        return max(INTERPRETED_KV_CACHE_BYTES, mib * 2**20)
    import psutil
    memory = psutil.virtual_memory()
    share = int(min(memory.total * KV_CACHE_SHARE, memory.available * KV_CACHE_SHARE_OF_AVAILABLE))
    quantum = 2**30 if share >= 2**30 else 2**28
    return max(quantum, share - share % quantum)


def worker_kv_cache_budget(worker) -> int:
    """The KV cache's budget of tpu-inference's TPUWorker `worker` on this host
    (`kv_cache_budget`), said in the log with how to set it."""
    from tpu_inference.logger import init_logger

    from tpu_models.host import attention_mode, host_platform
    log = init_logger("tpu_models.off_tpu")
    request = sum(spec.max_memory_usage_bytes(worker.vllm_config)
                  for spec in worker.get_kv_cache_spec().values())
    budget = kv_cache_budget(worker.cache_config, request)
    platform = host_platform()
    if worker.cache_config.kv_cache_memory_bytes:
        log.info("tpu-models: KV cache budget on this %s host: %.2f GiB", platform,
                 budget / 2**30)
    elif attention_mode() == "rpa-interpret":
        log.warning("tpu-models: KV cache budget %d MiB: the Pallas interpreter copies the "
                    "whole cache at every call (set it with --kv-cache-memory-bytes)",
                    budget >> 20)
    else:  # a guess: say how to choose
        log.warning("tpu-models: KV cache budget on this %s host: %.2f GiB, %d%% of its "
                    "memory in whole GiB (set it with --kv-cache-memory-bytes)",
                    platform, budget / 2**30, KV_CACHE_SHARE * 100)
    return budget


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of the host's memory, which its devices share."""
    import psutil
    memory = psutil.virtual_memory()
    return memory.available, memory.total


def memory_in_use(devices) -> list[tuple[int, int]]:
    """(bytes of live arrays, the host's RAM) per device: devices share the host's."""
    import jax
    import psutil
    used = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            used[shard.device] = used.get(shard.device, 0) + shard.data.nbytes
    total = psutil.virtual_memory().total
    return [(used.get(d, 0), total) for d in devices]


def copied(tensor):
    """`tensor` with each host array copied: the runner refills its buffers for the
    next step while this one may run, and on CPU device_put may alias them."""
    import jax
    return jax.tree.map(_copy, tensor)


def _copy(x):
    import jax
    import numpy as np
    return np.array(x, dtype=jax.dtypes.canonicalize_dtype(x.dtype)) if isinstance(
        x, np.ndarray) else x


def put_copies(tensor, sharding):
    """`tensor` on the devices from copies of its host arrays (`copied`), which go
    over with jit's own argument transfer (shard_args, jaxlib's): device_put's
    Python path cost a quarter of a demo step."""
    import jax
    import numpy as np
    from jax._src.lib import _jax
    from jax.sharding import NamedSharding, PartitionSpec, Sharding

    leaves, tree = jax.tree.flatten(tensor)
    copies = [_copy(x) for x in leaves]
    if isinstance(sharding, PartitionSpec) and not (mesh := jax.sharding.get_mesh()).empty:
        sharding = NamedSharding(mesh, sharding)  # the mesh device_put reads a bare spec in
    if isinstance(sharding, Sharding):
        # Already there: device_put's answer, without its Python path. Equivalent
        # counts: the runner asks P("data") of a P() array on a data axis of 1
        # (78-101 us a decode step for the async token substitution).
        if all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
               and x.committed and x.sharding.is_equivalent_to(sharding, x.ndim)
               for x in leaves):
            return tensor
        if all(isinstance(x, np.ndarray) for x in copies):
            n = len(copies)
            reuse = _jax.ArrayCopySemantics.REUSE_INPUT  # the copy is ours alone
            return jax.tree.unflatten(tree, _jax.shard_args(
                [sharding] * n, [None] * n, [reuse] * n, copies, fallback=_put_each))
    return jax.device_put(jax.tree.unflatten(tree, copies), sharding)


def put_for_the_step(device_put, tensor, sharding, layout=None, source_mesh=None):
    """tpu-inference's general_device_put (`device_put`) of `tensor`: host arrays
    copied before the step reads them, by `put_copies` where it takes them (no
    layout, no Ray)."""
    from tpu_inference import envs
    if layout is not None or envs.TPU_MULTIHOST_BACKEND == "ray":
        return device_put(copied(tensor), sharding, layout=layout, source_mesh=source_mesh)
    return put_copies(tensor, sharding)


def _put_each(shardings, _layouts, _semantics, arrays):
    import jax
    return [jax.device_put(x, s) for x, s in zip(arrays, shardings)]


def first_max(operand, *, axes, index_dtype):
    """argmax as XLA:CPU vectorizes it (its own (value, index) reduce is a scalar
    loop), the index argmax answers: the first of equal maxima, the first NaN where
    there is one.

    A last axis that splits into blocks is searched a block at a time: each block's
    maximum, the first block holding the largest, then the first position in it. At
    32 rows of Gemma 3's 262,144 ids: 2.5 ms, against 37 ms for a max and a least
    position over the whole axis (which XLA:CPU does not vectorize at that size) and
    18.5 ms for its own argmax. Other axes, and axes no block width divides: the
    max, then the least position holding it (at one row of 262,144 ids, 0.1 ms
    against 1.07 ms for XLA:CPU's argmax)."""
    import jax.numpy as jnp
    from jax import lax
    axis, = axes
    size = operand.shape[axis]
    width = next((w for w in (1024, 512, 256, 128) if size % w == 0 and size > w), None)
    if (width is None or axis != operand.ndim - 1
            or not jnp.issubdtype(operand.dtype, jnp.floating)):
        return _least_position_of_max(operand, axis, index_dtype)
    blocks = operand.reshape(*operand.shape[:-1], size // width, width)
    # Each block's maximum, NaN where the block holds one (XLA:CPU's max drops NaN).
    highest = lax.reduce(blocks, jnp.array(-jnp.inf, operand.dtype),
                         lambda a, b: jnp.where(jnp.isnan(b) | (b > a), b, a), (blocks.ndim - 1, ))
    block = _least_position_of_max(highest, highest.ndim - 1, index_dtype)
    inside = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]
    return block * width + _least_position_of_max(inside, inside.ndim - 1, index_dtype)


def _least_position_of_max(operand, axis, index_dtype):
    import jax.numpy as jnp
    from jax import lax
    hit = operand == jnp.max(operand, axis=axis, keepdims=True)
    if jnp.issubdtype(operand.dtype, jnp.floating):
        nan = jnp.isnan(operand)
        hit = jnp.where(jnp.any(nan, axis=axis, keepdims=True), nan, hit)
    positions = lax.broadcasted_iota(index_dtype, operand.shape, axis)
    return jnp.min(jnp.where(hit, positions, jnp.iinfo(index_dtype).max), axis=axis)


def argmax_as_two_reductions() -> None:
    """`first_max` as argmax's lowering on XLA:CPU, whose own is a scalar loop (greedy
    sampling, rejection, drafts, categorical)."""
    from jax import lax
    from jax.interpreters import mlir
    mlir.register_lowering(lax.argmax_p, mlir.lower_fun(first_max, multiple_results=False),
                           platform="cpu")


def sampler_without_tpu_options() -> None:
    """tpu-inference's sample(), jitted again without the xla_tpu_* options it took when
    it was decorated, at import (before plugins load). So did EAGLE-3's draft loop,
    whose replacement (speculative.draft) is jitted without them. Not a replacement
    by the guard: the seam's sampling wraps this jitted `sample` (its `lower` too)."""
    import importlib

    import jax

    from tpu_models.patching import rebind
    sampling = importlib.import_module("tpu_inference.layers.jax.sample.sampling")
    rebind(sampling.__name__, "sample",
           jax.jit(sampling.sample.__wrapped__,
                   static_argnames=["mesh", "allow_distributed_sampling"]))


def small_token_buckets() -> None:
    """Token buckets from 1: a TPU computes a 16-row step for the price of one, a CPU
    pays every padded row."""
    import os
    os.environ.setdefault("MIN_TOKEN_BUCKET", "1")


def mark(name: str, tensor, dtype):
    """Checkpoint tensor `name` to be cast to `dtype` (a torch dtype) by the loader,
    in its one pass (vLLM's warning about its dtype is then no news: logs)."""
    from tpu_models import logs
    logs.WIDENED_BY_LOADER.add(name)
    setattr(tensor, SERVED_DTYPE_ATTRIBUTE, dtype)
    return tensor


def as_marked(tensor):
    """`tensor` cast to the dtype marked on it (`mark`); unmarked, as it is."""
    served = getattr(tensor, SERVED_DTYPE_ATTRIBUTE, None)
    return tensor if served is None else tensor.to(served)


def _host_array(tensor):
    """A numpy view of a contiguous CPU tensor (bf16 through ml_dtypes), or None."""
    import ml_dtypes
    import torch
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if tensor.dtype in (torch.float16, torch.float32):
        return tensor.numpy()
    return None


def converted_in_one_pass(jax_param, torch_weight, reshape_dims, permute_dims):
    """The value of `jax_param` from a marked `torch_weight` (`mark`), read once and
    reshaped, permuted (default: a 2-D weight transposed, HF linear weights being
    (out, in)) and cast as tpu-inference's loader does; None where upstream's path
    must take it: unmarked, not a contiguous CPU float tensor, or of another shape
    once arranged (vocabulary padding)."""
    served = getattr(torch_weight, SERVED_DTYPE_ATTRIBUTE, None)
    host = None if served is None else _host_array(torch_weight)
    shape = tuple(reshape_dims or torch_weight.shape)
    if permute_dims is None and len(shape) == 2:
        permute_dims = (1, 0)
    perm = None if permute_dims is None else tuple(permute_dims)
    arranged_shape = shape if perm is None else tuple(shape[p] for p in perm)
    if host is None or arranged_shape != tuple(jax_param.get_value().shape):
        return None
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from tpu_inference.layers.common import utils as common
    from tpu_inference.utils import to_jax_dtype
    with common.cpu_mesh_context():
        # On the CPU mesh by name: across hosts, sharding it reads its pieces there.
        x = jax.device_put(host, NamedSharding(common.cpu_mesh(), PartitionSpec()))
        value = arranged(x, shape, perm, to_jax_dtype(served))
        value.block_until_ready()  # a streamed tensor's buffer is refilled next
    return value
