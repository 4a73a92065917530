"""The engine's start-up on a TPU slice that is not there: devices described by
libtpu, every array a shape, every program compiled and none run.

The devices are the slice's as libtpu describes it (jax.experimental.topologies),
with no chip behind them (`slice_devices`): the worker takes jax.devices(), and
kernels read its device kind. Every array the start-up would allocate (weights, KV
cache, host inputs, precompilation's dummy tensors) is an abstract buffer
(accounting.buffer), and HBM in use is what those hold (`hbm_usage`: the KV budget
is HBM less what the weights take). The model is built as the loader builds one
whose weights it will load (`build_model`). Each program precompilation names is
lowered and compiled by libtpu and kept (`compile_program`); a function that is
no jit (the rejection sampler, EAGLE-3's drafter) is called as the warm-up pass
calls it, with shapes (`warm_up`): every jit it calls compiles for the slice, as
on a TPU, and answers shapes (`compiled_for_the_slice`, `warmed_up_jits_compiled`).
An array made eagerly under the slice's mesh (jnp.ones) is made on the host
(`JaxEagerOnHost`, `precompilation_eager_on_host`), and
EAGLE-3's drafter, which borrows the target's embedding if its own is all zeros,
is answered by its checkpoint (`draft_embedding_answered`). adapt.topology
installs these in `tpu-models compile`'s process only.
"""

import contextlib
import dataclasses
import functools
import hashlib
import os
import time

from tpu_models.topology import costs
from tpu_models.topology.accounting import (
    DRAFT_WEIGHTS, HOST_INPUTS, KEEP_HLO_TEXT, KV_CACHE, LOWERED, PENDING, PROGRAMS, WEIGHTS,
    WORKER, Program, buffer, bytes_on, transient_bytes)

_devices: list = []
# The warm-up call under way (`calls_compile`): its task, mesh, what its outputs hold.
WARMING: list = []


def tracing() -> bool:
    """Whether JAX is tracing a function (then arrays are its tracers, not ours)."""
    from jax._src import core
    return not core.trace_state_clean()


def slice_devices() -> list:
    """The devices libtpu describes for the slice (first use: vLLM also loads the
    plugin in helper processes that never ask for devices)."""
    if not _devices:
        from jax.experimental import topologies

        from tpu_models.host import compile_target
        from tpu_models.topology.slices import topology

        slice_ = topology(compile_target())
        found = topologies.get_topology_desc(platform="tpu", topology_name=slice_.libtpu_name,
                                             chips_per_host_bounds=slice_.host_chips).devices
        _devices[:] = sorted(found, key=lambda d: d.id)
    return _devices


def local_slice_devices(process_index: int) -> list:
    """The slice's devices of one process."""
    return [d for d in slice_devices() if d.process_index == process_index]


def hbm_usage(devices) -> list[tuple[int, int]]:
    """Each device's (bytes in use, HBM), as tpu_inference.utils.hbm_usage_bytes
    answers: the live abstract buffers' bytes (accounting.bytes_on), against the
    worker's own table of HBM per device kind."""
    from tpu_inference import utils
    limit = utils.get_device_hbm_limit()
    return [(bytes_on(d), limit) for d in devices]


def kv_cache_allocator(cache_shape, cache_dtype, sharding):
    """An allocator of one KV cache (as tpu-inference's): an abstract buffer."""
    import jax
    return lambda: buffer(jax.ShapeDtypeStruct(cache_shape, cache_dtype), sharding, KV_CACHE)


def device_put(tensor, sharding):
    """Host inputs put on the slice's devices (general_device_put): abstract buffers. A
    sharding that is a PartitionSpec (or None) is on the current mesh, or the mesh of
    the warm-up call under way."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    if not isinstance(sharding, jax.sharding.Sharding):
        mesh = jax.sharding.get_mesh()
        if mesh.empty and WARMING:
            mesh = WARMING[1]
        sharding = NamedSharding(mesh, sharding or PartitionSpec())
    return jax.tree.map(lambda x: buffer(x, sharding, HOST_INPUTS), tensor)


def keep_worker(worker) -> None:
    """The worker, kept for the report (accounting.WORKER)."""
    WORKER[:] = [worker]


def build_model(model_class, vllm_config, rng, mesh, is_draft_model=False):
    """As the loader builds a model whose weights it will load: the class under
    nnx.eval_shape, Qwix applied to it the way the configuration asks, each weight an
    abstract buffer where the loader puts it (its partition spec)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec
    from tpu_inference.models.jax.utils.qwix import qwix_utils

    if getattr(model_class, "_self_manages_sharding", False):
        raise NotImplementedError(f"{model_class.__name__} builds its own sharded weights "
                                  "(_self_manages_sharding): it cannot be built abstractly")
    build = functools.partial(model_class, vllm_config, rng, mesh)
    on_abstract = qwix_utils.apply_qwix_on_abstract_model(vllm_config)
    if on_abstract:
        build = qwix_utils.apply_qwix_quantization(vllm_config, build, rng, mesh,
                                                   apply_to_abstract_model=True)
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(build, graph_updates=False)
    state = nnx.state(model)
    specs = nnx.get_partition_spec(state)
    holds = DRAFT_WEIGHTS if is_draft_model else WEIGHTS
    placed = jax.tree.map(
        lambda x, spec: buffer(x, NamedSharding(mesh, spec or PartitionSpec()), holds),
        state, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    nnx.update(model, placed)
    if on_abstract:
        return model
    # Qwix's quantization of the loaded model (a no-op without rules): its jit
    # compiles for the slice, and the quantized weights are placed as it places them.
    with calls_compile(Program("load > Qwix quantization", {}), mesh, holds):
        return qwix_utils.apply_qwix_quantization(vllm_config, model, rng, mesh,
                                                  apply_to_abstract_model=False)


def dummy_tensor(mesh, shape, dtype, sharding=None):
    """A precompilation input: an abstract buffer."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from tpu_inference.utils import to_jax_dtype
    sharding = sharding or NamedSharding(mesh, PartitionSpec(None))
    return buffer(jax.ShapeDtypeStruct(tuple(shape), to_jax_dtype(dtype)), sharding,
                  "precompilation inputs")


def compile_program(manager, name, fn, args, call_kwargs, warmup_handler, described):
    """A program precompilation names (`described`: its signature's values), lowered
    and compiled for the slice (on the manager's workers where it has them), kept
    in PROGRAMS; a function that is no jit waits for the warm-up pass (`warm_up`)."""
    import jax
    from tpu_inference.runner.compilation_manager import _describe_signature
    program = Program(name, _describe_signature(described))
    PROGRAMS.append(program)
    while isinstance(fn, functools.partial):  # as upstream: the jit's own static args
        args, call_kwargs, fn = fn.args + args, {**fn.keywords, **call_kwargs}, fn.func
    program.transient_input_bytes = transient_bytes(args, call_kwargs)
    if not hasattr(fn, "lower"):  # its jits compile when the warm-up pass calls it
        PROGRAMS.remove(program)
        manager._warmup_tasks.append((program, fn, args, call_kwargs, warmup_handler))
        return
    mesh = manager.runner.mesh
    args, call_kwargs = one_dummy_shape(args, call_kwargs)
    began = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            lowered = fn.lower(*args, **call_kwargs)
    except Exception as e:  # named in the report
        program.error = f"lowering failed: {type(e).__name__}: {e}"
        return
    program.lowering_seconds = time.perf_counter() - began
    key = (getattr(fn, "__qualname__", repr(fn)),
           hashlib.sha256(lowered.as_text().encode()).hexdigest())
    # Each variant is traced once, for its own shapes: JAX's tracing caches kept every
    # one (2 GB of 5 at TP 8 on v6e-8).
    jax.clear_caches()
    if key in LOWERED:
        program.same_as = LOWERED[key]
        return
    LOWERED[key] = program
    if manager._compile_executor is None:
        _compile(program, lowered, mesh)
    else:
        PENDING.append(manager._compile_executor.submit(_compile, program, lowered, mesh))


def one_dummy_shape(args, kwargs):
    """`args, kwargs` with tpu-inference's `_cache_collision_dummy` in one shape. Its
    shape only keeps a program's log-probs and plain variants apart in JAX's cache
    (the program adds `0 * sum(dummy)`, which XLA removes), so both lower to one
    module and compile once (`same_program_as`): half of the sampler's compiles."""
    import jax

    def one_shape(path, leaf):
        if "_cache_collision_dummy" in jax.tree_util.keystr(path):
            return jax.ShapeDtypeStruct((1,), leaf.dtype, sharding=leaf.sharding)
        return leaf
    return jax.tree_util.tree_map_with_path(one_shape, (args, kwargs))


def _compile(program: Program, lowered, mesh) -> None:
    """libtpu compiles `lowered`; its costs (or its error) and time go to `program`."""
    import jax
    began = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            program.costs = costs.of(lowered.compile(), KEEP_HLO_TEXT[0])
    except Exception as e:
        program.error = f"{type(e).__name__}: {e}"
    program.seconds = time.perf_counter() - began
    _return_freed_memory()


@functools.cache
def _libc():
    import ctypes
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


_TRIMMED = [0.0]


def _return_freed_memory(every: float = 5.0) -> None:
    """What libtpu freed after compiles goes back to the system, every few seconds
    (a trim walks every arena): glibc keeps it in each compiling thread's arena
    otherwise, a gigabyte over 158 programs."""
    if (libc := _libc()) is not None and time.monotonic() - _TRIMMED[0] > every:
        _TRIMMED[0] = time.monotonic()
        libc.malloc_trim(0)


def warm_up(manager) -> None:
    """The manager's warm-up tasks called with shapes: each jit they call compiles
    for the slice and returns shapes."""
    import jax
    tasks, manager._warmup_tasks = manager._warmup_tasks, []
    for task, fn, args, call_kwargs, handler in tasks:
        try:
            with calls_compile(task, manager.runner.mesh):
                handler(fn, args, call_kwargs) if handler else fn(*args, **call_kwargs)
            jax.clear_caches()  # as after each lowering (compile_program)
        except Exception as e:
            if os.environ.get("TPU_MODELS_COMPILE_TRACEBACKS"):
                import traceback
                traceback.print_exc()
            PROGRAMS.append(dataclasses.replace(
                task, error=f"its warm-up call failed: {type(e).__name__}: {e}"))


@contextlib.contextmanager
def calls_compile(task: Program, mesh, holds: str | None = None):
    """Calls of jitted functions with abstract arguments compile for the slice and
    return abstract outputs (`compiled_for_the_slice`), as `task`'s programs. Under
    the slice's abstract mesh only: arrays made eagerly are made on the host."""
    import jax
    WARMING[:] = [task, mesh, holds]
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            yield
    finally:
        WARMING.clear()


def unsafe_call_compiling(build):
    """MeshExecutable.unsafe_call's getter (`build`: upstream's), whose call during a
    warm-up call with abstract arguments compiles for the slice
    (`compiled_for_the_slice`) rather than run."""
    def unsafe_call(executable):
        if not WARMING:
            return build(executable)

        def call(*args):
            outputs = compiled_for_the_slice(executable, args)
            return build(executable)(*args) if outputs is None else outputs

        return call

    return unsafe_call


def warmed_up_jits_compiled() -> None:
    """MeshExecutable.unsafe_call, a property replaced whole (`unsafe_call_compiling`)."""
    from jax._src.interpreters import pxla
    build = pxla.MeshExecutable.unsafe_call.fget
    pxla.MeshExecutable.unsafe_call = property(unsafe_call_compiling(build))


def compiled_for_the_slice(executable, args) -> list | None:
    """A compiled executable's call during a warm-up call with abstract arguments:
    kept as the task's program, answered with abstract outputs. None: run it."""
    import jax
    if not WARMING or not any(isinstance(a, jax.ShapeDtypeStruct) for a in args):
        return None
    task, _, holds = WARMING
    name = executable.xla_executable.hlo_modules()[0].name.removeprefix("jit_")
    PROGRAMS.append(dataclasses.replace(task, name=f"{task.name} > {name}",
                                        costs=costs.of(executable, KEEP_HLO_TEXT[0]),
                                        warm_up=task.name,
                                        transient_input_bytes=transient_bytes(args)))
    return [buffer(aval, sharding, holds or _holds_like(aval, sharding, args))
            for aval, sharding in zip(executable.out_avals, executable._out_shardings)]


def _holds_like(aval, sharding, args) -> str:
    """What an output holds: an input of its shape and placement (a donated KV cache,
    updated) holds the same; anything else is the call's own output."""
    for a in args:
        if (getattr(a, "holds", None) and a.shape == aval.shape and a.dtype == aval.dtype
                and a.sharding.is_equivalent_to(sharding, len(a.shape))):
            return a.holds
    return "warm-up outputs"


class JaxEagerOnHost:
    """jax, except that `set_mesh` of the slice's mesh sets only its abstract mesh: an
    array created eagerly inside (jnp.ones) is made on the host and then placed, as
    shapes, by device_array; on the slice's devices it could not be made at all."""

    def __init__(self, jax):
        self._jax = jax

    def __getattr__(self, name):
        return getattr(self._jax, name)

    def set_mesh(self, mesh):
        return self._jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def precompilation_eager_on_host() -> None:
    """The compilation manager's module global `jax`, replaced by `JaxEagerOnHost`."""
    import jax
    from tpu_inference.runner import compilation_manager
    compilation_manager.jax = JaxEagerOnHost(jax)


class EmbeddingAnswers:
    """jax.numpy, except that `any` and `array_equal` of abstract values answer what
    the draft's checkpoint says: whether it ships an embedding of its own."""

    def __init__(self, real, own_embedding: bool):
        self.real, self.own = real, own_embedding

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _shapes_only(self, *xs) -> bool:
        import jax
        return any(isinstance(x, jax.ShapeDtypeStruct) for x in xs)

    def any(self, x, *args, **kwargs):
        return self.own if self._shapes_only(x) else self.real.any(x, *args, **kwargs)

    def array_equal(self, a, b, *args, **kwargs):
        return False if self._shapes_only(a, b) else self.real.array_equal(a, b, *args, **kwargs)


@contextlib.contextmanager
def draft_embedding_answered(eagle3, draft: str):
    """While EAGLE-3's drafter loads (`eagle3`: tpu-inference's module): its check of
    whether the draft's embedding is all zeros, which reads values absent here, answered
    by the draft's checkpoint (`draft`: its path)."""
    answers = EmbeddingAnswers(eagle3.jnp, ships_embedding(draft))
    eagle3.jnp = answers
    try:
        yield
    finally:
        eagle3.jnp = answers.real


def ships_embedding(draft: str) -> bool:
    """Whether a draft checkpoint holds an embedding (a directory of safetensors);
    EAGLE-3 drafts usually do not, and borrow the target's."""
    from pathlib import Path

    from safetensors import safe_open
    for file in sorted(Path(draft).glob("*.safetensors")) if Path(draft).is_dir() else ():
        with safe_open(file, "np") as f:
            if any("embed_tokens" in name for name in f.keys()):
                return True
    return False
