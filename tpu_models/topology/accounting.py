"""Compiling for a TPU slice: what each chip would hold and which programs compiled.

In `tpu-models compile` every array the engine's start-up would allocate is an
abstract buffer (`buffer`): a ShapeDtypeStruct placed on the slice's devices,
labelled with what it holds and alive while something refers to it, so HBM in
use is counted from the live ones (`bytes_on`). Each program precompilation
names is a `Program` in PROGRAMS. The start-up on the slice (abstract.py)
records these; the compile's report reads them.
"""

import dataclasses
import functools
import weakref

from tpu_models.topology import costs as program_costs

# What an abstract buffer holds, when the chip keeps it between steps (KEPT).
WEIGHTS, DRAFT_WEIGHTS, KV_CACHE, HOST_INPUTS = "weights", "draft weights", "kv_cache", "host inputs"
# Any other label (a dummy made for precompilation, a warm-up's output) is the step's.
KEPT = (WEIGHTS, DRAFT_WEIGHTS, KV_CACHE, HOST_INPUTS)

# Every abstract buffer still referenced (HBM in use), by identity: buffers of the
# same shape are equal, and each layer's KV cache is one.
_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _buffer_class():
    import jax

    class Buffer(jax.ShapeDtypeStruct):
        """An array as a device would hold it, with what it holds; alive as long as
        something refers to it (as a device buffer is)."""
        __slots__ = ("holds", "__weakref__")

    return Buffer


_Buffer = functools.cache(_buffer_class)


def buffer(x, sharding, holds: str):
    import jax
    import numpy as np
    dtype = x.dtype
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    out = _Buffer()(np.shape(x), dtype, sharding=sharding)
    out.holds = holds
    _live[id(out)] = out
    return out


def _shard_shape(x) -> tuple[int, ...]:
    try:
        return tuple(x.sharding.shard_shape(x.shape))
    except ValueError:  # a spec its shape cannot split: XLA keeps it whole
        return tuple(x.shape)


def _shard_bytes(x) -> int:
    """Bytes of one device's shard of the placed abstract array `x`."""
    import math
    return math.prod(_shard_shape(x)) * x.dtype.itemsize


def shard_shapes(device, holds: str) -> dict[tuple[str, tuple[int, ...]], int]:
    """How many live abstract buffers holding `holds` have each (dtype, shape) as
    `device`'s shard: a program's HLO parameters are told apart by these."""
    out: dict[tuple[str, tuple[int, ...]], int] = {}
    for x in list(_live.values()):
        if x.holds == holds and x.sharding is not None and device in x.sharding.device_set:
            key = (str(x.dtype), _shard_shape(x))
            out[key] = out.get(key, 0) + 1
    return out


def bytes_by_dtype(device, holds: str | None = None) -> dict[str, int]:
    """Bytes of the live abstract buffers (those holding `holds`, or all) on `device`,
    by dtype."""
    out: dict[str, int] = {}
    for x in list(_live.values()):
        if holds is not None and x.holds != holds:
            continue
        if x.sharding is None or device not in x.sharding.device_set:
            continue
        name = str(x.dtype)
        out[name] = out.get(name, 0) + _shard_bytes(x)
    return out


def bytes_on(device, holds: str | None = None) -> int:
    """Bytes of the live abstract buffers (those holding `holds`, or all) on `device`."""
    return sum(bytes_by_dtype(device, holds).values())


@dataclasses.dataclass
class Program:
    """One precompiled program: what the runner names it, its shapes, and libtpu's result."""
    name: str
    signature: dict  # the runner's description of the variant (num_tokens, num_reqs, ...)
    costs: program_costs.Costs | None = None  # what libtpu says of it, once compiled
    error: str | None = None  # why it did not compile
    seconds: float = 0.0
    # Compiled by a warm-up call of a Python function that calls jits (`warm_up` names
    # it), as a TPU compiles them: not ahead of time.
    warm_up: str | None = None
    # A chip's bytes of its inputs that exist only for the step (logits, ids), beside
    # what the chip keeps (weights, KV cache, slots): with its temporaries and outputs,
    # what the program needs beyond them.
    transient_input_bytes: int = 0
    lowering_seconds: float = 0.0
    # An earlier program of the same function whose lowered module is this one's, text
    # for text (variants that differ in an argument the program ignores): compiled once.
    same_as: "Program | None" = None


def transient_bytes(*trees) -> int:
    """A chip's bytes of the step-only inputs among `trees` (the most any chip holds)."""
    import jax
    per_device: dict = {}
    for x in jax.tree.leaves(trees):
        if (not isinstance(x, jax.ShapeDtypeStruct) or getattr(x, "holds", None) in KEPT
                or x.sharding is None):
            continue
        for d in x.sharding.device_set:
            per_device[d] = per_device.get(d, 0) + _shard_bytes(x)
    return max(per_device.values(), default=0)


# The programs this process compiled, in precompilation order, and its worker
# (for the report, also when start-up stops: what would fit is worked out from it).
PROGRAMS: list[Program] = []
WORKER: list = []
# (function, its lowered module's digest) -> the program that compiles it.
LOWERED: dict[tuple[str, str], Program] = {}
# Whether each program's optimized HLO text is kept (tpu-models compile --dump-hlo).
KEEP_HLO_TEXT = [False]
# Compilations under way. Nothing waits for them until the report (settled): the
# main thread lowers the next group (the backbone's Pallas kernels, Python-bound)
# while the workers compile the last one, where upstream waits at each group's end.
PENDING: list = []


def settled() -> list[Program]:
    """PROGRAMS, each compiled or failed: every compilation under way waited for."""
    while PENDING:
        PENDING.pop().result()
    for program in PROGRAMS:
        if program.same_as is not None and program.costs is None:
            program.costs, program.error = program.same_as.costs, program.same_as.error
    return PROGRAMS
