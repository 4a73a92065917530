"""Compiling for a TPU topology: the model built and every start-up program compiled, none run.

The model is built as the loader builds one whose weights it will load (its
class under nnx.eval_shape, each weight placed by its partition spec, Qwix's
quantization compiled for the slice). Each program precompilation names is
lowered and compiled by libtpu, and kept (PROGRAMS, in tpu_models.slice_accounting
with what each chip holds). A function that is no jit (the rejection sampler,
EAGLE-3's drafter) is called as the warm-up pass calls it, with shapes: every
jit it calls compiles for the slice, as on a TPU, and answers shapes. Installed
only in `tpu-models compile`'s process (guard.COMPILING).
"""

import contextlib
import dataclasses
import functools
import hashlib
import os
import time

from tpu_models import program_costs
from tpu_models.adapt.guard import COMPILING, COMPILE_ONLY, Patch, Target
from tpu_models.adapt.topology import WARMING
from tpu_models.slice_accounting import (
    DRAFT_WEIGHTS, KEEP_HLO_TEXT, LOWERED, PENDING, PROGRAMS, WEIGHTS, WORKER, Program, buffer,
    transient_bytes)


def model_built_abstractly() -> None:
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec
    from tpu_inference.models.common import model_loader
    from tpu_inference.models.jax.utils.qwix import qwix_utils
    from tpu_inference.worker.tpu_worker import TPUWorker

    def _get_nnx_model(model_class, vllm_config, rng, mesh, pooler=None, is_draft_model=False):
        # As the loader builds a model whose weights it will load: the class under
        # nnx.eval_shape, Qwix applied to it the way the configuration asks.
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
        # Each weight where the loader puts it (its partition spec)...
        state = nnx.state(model)
        specs = nnx.get_partition_spec(state)
        holds = DRAFT_WEIGHTS if is_draft_model else WEIGHTS
        placed = jax.tree.map(
            lambda x, spec: buffer(x, NamedSharding(mesh, spec or PartitionSpec()), holds),
            state, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
        nnx.update(model, placed)
        if on_abstract:
            return model
        # ... then Qwix's quantization of the loaded model (a no-op without rules): its
        # jit compiles for the slice, and the quantized weights are placed as it places them.
        with _calls_compile(Program("load > Qwix quantization", {}), mesh, holds):
            return qwix_utils.apply_qwix_quantization(vllm_config, model, rng, mesh,
                                                      apply_to_abstract_model=False)

    model_loader._get_nnx_model = _get_nnx_model
    load = TPUWorker.load_model

    def load_model(self):
        WORKER[:] = [self]
        return load(self)

    TPUWorker.load_model = load_model


def programs_compiled_not_run() -> None:
    from tpu_inference.runner.compilation_manager import CompilationManager

    CompilationManager._create_dummy_tensor = _create_dummy_tensor
    CompilationManager._run_compilation = _run_compilation
    CompilationManager._flush_compilations = _flush_compilations


def _create_dummy_tensor(self, shape, dtype, sharding=None):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from tpu_inference.utils import to_jax_dtype
    sharding = sharding or NamedSharding(self.runner.mesh, PartitionSpec(None))
    return buffer(jax.ShapeDtypeStruct(tuple(shape), to_jax_dtype(dtype)), sharding,
                  "precompilation inputs")


def _run_compilation(self, name, fn, *args, call_kwargs=dict(), warmup_handler=None,
                     aot=True, compile_only=False, **kwargs):
    import jax
    from tpu_inference.runner.compilation_manager import _describe_signature
    program = Program(name, _describe_signature(kwargs))
    PROGRAMS.append(program)
    while isinstance(fn, functools.partial):  # as upstream: the jit's own static args
        args, call_kwargs, fn = fn.args + args, {**fn.keywords, **call_kwargs}, fn.func
    program.transient_input_bytes = transient_bytes(args, call_kwargs)
    if not hasattr(fn, "lower"):  # its jits compile when the warm-up pass calls it
        PROGRAMS.remove(program)
        self._warmup_tasks.append((program, fn, args, call_kwargs, warmup_handler))
        return
    mesh = self.runner.mesh
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
    if key in LOWERED:
        program.same_as = LOWERED[key]
        return
    LOWERED[key] = program
    if self._compile_executor is None:
        _compile(program, lowered, mesh)
    else:
        PENDING.append(self._compile_executor.submit(_compile, program, lowered, mesh))


def _compile(program: Program, lowered, mesh) -> None:
    """libtpu compiles `lowered`; its costs (or its error) and time go to `program`."""
    import jax
    began = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            program.costs = program_costs.of(lowered.compile(), KEEP_HLO_TEXT[0])
    except Exception as e:
        program.error = f"{type(e).__name__}: {e}"
    program.seconds = time.perf_counter() - began


def _flush_compilations(self):
    tasks, self._warmup_tasks = self._warmup_tasks, []
    for task, fn, args, call_kwargs, handler in tasks:
        try:  # called with shapes: each jit it calls compiles, returns shapes
            with _calls_compile(task, self.runner.mesh):
                handler(fn, args, call_kwargs) if handler else fn(*args, **call_kwargs)
        except Exception as e:
            if os.environ.get("TPU_MODELS_COMPILE_TRACEBACKS"):
                import traceback
                traceback.print_exc()
            PROGRAMS.append(dataclasses.replace(
                task, error=f"its warm-up call failed: {type(e).__name__}: {e}"))


@contextlib.contextmanager
def _calls_compile(task: Program, mesh, holds: str | None = None):
    """Calls of jitted functions with abstract arguments compile for the slice and
    return abstract outputs (warmed_up_jits_compiled), as `task`'s programs. Under
    the slice's abstract mesh only: arrays made eagerly are made on the host."""
    import jax
    WARMING[:] = [task, mesh, holds]
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            yield
    finally:
        WARMING.clear()


def _holds_like(aval, sharding, args) -> str:
    """What an output holds: an input of its shape and placement (a donated KV cache,
    updated) holds the same; anything else is the call's own output."""
    for a in args:
        if (getattr(a, "holds", None) and a.shape == aval.shape and a.dtype == aval.dtype
                and a.sharding.is_equivalent_to(sharding, len(a.shape))):
            return a.holds
    return "warm-up outputs"


def warmed_up_jits_compiled() -> None:
    import jax
    from jax._src.interpreters import pxla

    build = pxla.MeshExecutable.unsafe_call.fget

    def unsafe_call(self):
        if not WARMING:
            return build(self)

        def compiled_for_the_slice(*args):
            if not any(isinstance(a, jax.ShapeDtypeStruct) for a in args):
                return build(self)(*args)
            task = WARMING[0]
            name = self.xla_executable.hlo_modules()[0].name.removeprefix("jit_")
            PROGRAMS.append(dataclasses.replace(task, name=f"{task.name} > {name}",
                                                costs=program_costs.of(self, KEEP_HLO_TEXT[0]),
                                                warm_up=task.name,
                                                transient_input_bytes=transient_bytes(args)))
            holds = WARMING[2]
            return [buffer(aval, sharding, holds or _holds_like(aval, sharding, args))
                    for aval, sharding in zip(self.out_avals, self._out_shardings)]

        return compiled_for_the_slice

    pxla.MeshExecutable.unsafe_call = property(unsafe_call)


class _JaxEagerOnHost:
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
    import jax
    from tpu_inference.runner import compilation_manager

    compilation_manager.jax = _JaxEagerOnHost(jax)


class _EmbeddingAnswers:
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


def _ships_embedding(draft: str) -> bool:
    """Whether a draft checkpoint holds an embedding (a directory of safetensors);
    EAGLE-3 drafts usually do not, and borrow the target's."""
    from pathlib import Path

    from safetensors import safe_open
    for file in sorted(Path(draft).glob("*.safetensors")) if Path(draft).is_dir() else ():
        with safe_open(file, "np") as f:
            if any("embed_tokens" in name for name in f.keys()):
                return True
    return False


def draft_embedding_from_its_checkpoint() -> None:
    from tpu_inference.spec_decode.jax import eagle3

    original = eagle3.Eagle3Proposer.load_model

    def load_model(self, target_model):
        draft = self.vllm_config.speculative_config.draft_model_config.model
        answers = _EmbeddingAnswers(eagle3.jnp, _ships_embedding(draft))
        eagle3.jnp = answers
        try:
            return original(self, target_model)
        finally:
            eagle3.jnp = answers.real

    eagle3.Eagle3Proposer.load_model = load_model


# The test that fails without each patch.
TESTS = {
    "model built abstractly": "test_int8_qwen3_at_tensor_parallel_4_in_the_kv_budget_asked",
    "EAGLE-3 draft embedding decided by its checkpoint": "test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8",
    "programs compiled, kept, never run": "test_the_program_set_is_what_a_cpu_server_precompiles",
    "warm-up calls compile their jits, run none": "test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8",
    "precompilation's eager arrays made on the host": "test_demo_with_eagle3_at_tensor_parallel_8_on_v6e_8",
}


def _patch(name, targets, why, install):
    return Patch(name, COMPILE_ONLY, tuple(Target(*t) for t in targets), why,
                 f"tests/test_compile.py::{TESTS[name]}", install, platform=COMPILING)


MANAGER = "tpu_inference.runner.compilation_manager.CompilationManager"
_RUN = "self name fn args call_kwargs warmup_handler aot compile_only kwargs"
PATCHES = [
    _patch("model built abstractly", [
        ("tpu_inference.models.common.model_loader._get_nnx_model",
         "model_class vllm_config rng mesh pooler is_draft_model"),
        ("tpu_inference.models.jax.utils.qwix.qwix_utils.apply_qwix_quantization",
         "vllm_config model_or_model_fn rng mesh apply_to_abstract_model"),
        ("tpu_inference.models.jax.utils.qwix.qwix_utils.apply_qwix_on_abstract_model",
         "vllm_config"),
        ("tpu_inference.worker.tpu_worker.TPUWorker.load_model", "self")],
        "loading writes weights into device memory the slice does not have",
        model_built_abstractly),
    _patch("EAGLE-3 draft embedding decided by its checkpoint", [
        ("tpu_inference.spec_decode.jax.eagle3.Eagle3Proposer.load_model", "self target_model")],
        "the drafter borrows the target's embedding if its own is all zeros: values, absent here",
        draft_embedding_from_its_checkpoint),
    _patch("programs compiled, kept, never run", [
        (f"{MANAGER}._run_compilation", _RUN), (f"{MANAGER}._flush_compilations", "self"),
        (f"{MANAGER}._create_dummy_tensor", "self shape dtype sharding"),
        ("tpu_inference.runner.compilation_manager._describe_signature", "kwargs")],
        "precompilation runs every program once on dummy inputs after compiling it",
        programs_compiled_not_run),
    _patch("warm-up calls compile their jits, run none", [
        ("jax._src.interpreters.pxla.MeshExecutable.unsafe_call.fget", "self")],
        "a function that is no jit compiles its jits when the warm-up pass calls it",
        warmed_up_jits_compiled),
    _patch("precompilation's eager arrays made on the host", [
        (f"{MANAGER}.capture_model", "self"), ("jax.set_mesh", "mesh")],
        "an array made eagerly under the slice's mesh (jnp.ones) cannot be made: no chip",
        precompilation_eager_on_host),
]
