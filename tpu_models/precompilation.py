"""What a server start compiles, and when: the policy the seam (adapt/compilation.py)
carries out and the ready line reports, the model step with the `lower` the
precompiler looks for (`AheadOfTimeStep`), and the buckets compiled after ready
(`compile_in_background`).

tpu-inference compiles the model step once per token bucket before it serves,
but only functions with a `lower` take part in its parallel ahead-of-time pass:
the flax step is a Python function that picks a jit, so each bucket was traced,
compiled (or read back from JAX's cache) and run once, one after another. Here
the step lowers ahead of time (`with_the_step_lowered_ahead`), and a bucket
compiled that way is not also run (`warm_up_tasks_to_run`). Off-TPU the buckets
between the smallest and the largest then compile in the background once the
server is ready (`ready_buckets`, `rest_in_background`); until one is compiled, a
step pads to the next compiled bucket. Across hosts they compile at first use
instead. Figures: benchmarks/README.md (bench startup).

Off-TPU precompilation also overlaps with the compile workers. tpu-inference waits
for each group's compilations before it lowers the next, and precompiles the
sampler before the KV cache exists (to keep HBM free for it); off-TPU both only
serialize: the sampler at every request bucket (2 s at 0.6B, read back from the
cache) ran before the step's buckets, and each group waited for the step's largest
bucket (3 s). There the sampler waits for capture_model, whose flushes then wait for
nothing: the main thread lowers every group while the workers compile, and
capture_model's end waits for all. With EAGLE-3 steps fused (adapt.spec_fusion),
upstream's speculative programs (rejection samplers, row selections, the draft's
passes: 290 of the demo's 370) run only in the steps the fused one leaves them
(logprobs, penalties): they compile at first use.

Mosaic lowering caches each Pallas kernel equation under a key whose hash takes a
DMA's pytree without its nodes' data: a kernel's DMAs all hash alike, and each
lookup compared keys in full (RPA v3: a million comparisons, 2.5 of 8.8 s a
lowering); `hashed_by_their_trees` hashes the trees too
(`pallas_keys_hashed_by_their_trees` installs it).
"""

import atexit
import contextlib
import dataclasses
import logging
import os
import threading
import time


def background_buckets(vllm_config) -> bool:
    """Whether token buckets compile after the server is ready: off-TPU, when it
    precompiles at all, for a plain text model on one rank (LoRA slots, drafts,
    pipeline and data parallel ranks each add programs a bucket depends on). Across
    hosts at first use, not in the background (`rest_in_background`)."""
    from tpu_inference import envs

    from tpu_models.host import host_platform

    parallel = vllm_config.parallel_config
    return (host_platform() is not None and not envs.SKIP_JAX_PRECOMPILE
            and not vllm_config.model_config.enforce_eager and vllm_config.lora_config is None
            and vllm_config.speculative_config is None
            and not vllm_config.model_config.is_multimodal_model
            and parallel.pipeline_parallel_size == 1 and parallel.data_parallel_size == 1)


def ready_buckets(paddings: list[int]) -> list[int]:
    """Compiled before the server is ready: the smallest bucket (one decode) and the
    largest (any prompt, chunk by chunk). Until the others compile, a step pads to
    the next of these."""
    return sorted({paddings[0], paddings[-1]})


def _log():
    from tpu_inference.logger import init_logger
    return init_logger("tpu_models.adapt")


class AheadOfTimeStep:
    """tpu-inference's flax model step (a function choosing a jit per KV-cache
    sharding), with the `lower` its precompiler looks for."""

    def __init__(self, step, resolve, takes_spec_step: bool):
        self._step, self._resolve, self._takes_spec_step = step, resolve, takes_spec_step

    @classmethod
    def wrap(cls, step):
        """None where the step is not tpu-inference 0.32's (then it stays as it is)."""
        import inspect
        try:
            names = inspect.getclosurevars(step).nonlocals
        except TypeError:
            return None
        if "_resolve_step_fn" not in names or "model_supports_spec_step" not in names:
            return None
        return cls(step, names["_resolve_step_fn"], names["model_supports_spec_step"])

    def __call__(self, *args, **kwargs):
        return self._step(*args, **kwargs)

    def lower(self, *args, **kwargs):
        # What the step does before it calls its jit (model_loader.wrapped_model_fn).
        if not self._takes_spec_step:
            kwargs.pop("spec_step_idx", None)
        kwargs.pop("shared_attention_metadata", None)
        return self._resolve(args[1], True).lower(*args, **kwargs)


def with_the_step_lowered_ahead(interface):
    """model_loader.get_flax_model's interface, its step an `AheadOfTimeStep`; as it
    was (said in the log) where the step is not tpu-inference 0.32's."""
    step = AheadOfTimeStep.wrap(interface.model_fn)
    if step is None:
        _log().warning("tpu-models: the model step cannot be lowered ahead of time on "
                       "this tpu-inference; each bucket compiles in the warm-up pass")
        return interface
    return dataclasses.replace(interface, model_fn=step)


@contextlib.contextmanager
def noting_a_task_compiled_ahead(manager, compiled_ahead: set):
    """Around the compilation manager's _run_compilation: the warm-up task it adds for a
    function it gave a worker to compile is noted in `compiled_ahead` (by id)."""
    tasks, futures = len(manager._warmup_tasks), len(manager._compile_futures)
    yield
    if len(manager._warmup_tasks) > tasks and len(manager._compile_futures) > futures:
        compiled_ahead.add(id(manager._warmup_tasks[-1]))


def warm_up_tasks_to_run(tasks: list, compiled_ahead: set) -> list:
    """The warm-up pass's tasks, less those compiled ahead (`compiled_ahead`, emptied).
    The pass calls every precompiled function once, to fill the caches of functions it
    could not lower. One compiled ahead is in jit's caches already, and its call was
    pure cost: a forward pass per bucket of the step (4 s at 256 tokens for a 0.6B
    model on CPU), the sampler at 64 rows of a 152k vocabulary."""
    kept = [task for task in tasks if id(task) not in compiled_ahead]
    compiled_ahead.clear()
    return kept


def deferring(runner) -> bool:
    """Whether the runner's token buckets compile partly after ready: its step lowers
    ahead of time, on one data-parallel rank, where `background_buckets` says so."""
    return (isinstance(runner.model_fn, AheadOfTimeStep) and runner.dp_size == 1
            and background_buckets(runner.vllm_config))


@contextlib.contextmanager
def buckets_of(runner, paddings: list[int] | None):
    """The runner's token buckets are `paddings` inside (the step's precompilation
    reads them; None: all of them), all of them again after."""
    if paddings is None:
        yield
        return
    every = runner.num_tokens_paddings
    runner.num_tokens_paddings = paddings
    try:
        yield
    finally:
        runner.num_tokens_paddings = every


def rest_in_background(runner, every: list[int]) -> threading.Thread | None:
    """Once the `ready_buckets` of `every` are compiled: the runner pads a step to
    those, and the others compile in the background (None: there are none, or the
    server spans hosts). Across hosts each host would pad a step to the buckets it
    had compiled by then, and hosts running different programs break each other's
    collectives: there a bucket compiles when a step first meets it, on every host
    at that same step."""
    from tpu_models.multihost import serving_across_hosts

    ready = ready_buckets(every)
    rest = [b for b in every if b not in ready]
    if not rest:
        return None
    if serving_across_hosts():
        _log().info("tpu-models: token buckets %s compiled; %s compile when a step first "
                    "meets them, on every host at that step", ready, rest)
        return None
    runner.num_tokens_paddings_per_dp = ready
    _log().info("tpu-models: token buckets %s compiled; %s compile in the background "
                "(until then a step pads to the next compiled one)", ready, rest)
    return compile_in_background(runner, rest)


def unfused_programs_at_first_use() -> None:
    """Said in the log where EAGLE-3's unfused programs are left to compile at first use."""
    _log().info("tpu-models: EAGLE-3's unfused programs (for steps with logprobs or "
                "penalties) compile when a step first needs them")


class _RunnerView:
    """The runner as the background compiler sees it: the buckets left, and the KV
    caches as shapes (the engine donates the real ones at every step)."""

    def __init__(self, runner, paddings, kv_caches):
        self._runner, self.num_tokens_paddings, self.kv_caches = runner, paddings, kv_caches

    def __getattr__(self, name):
        return getattr(self._runner, name)


def compile_in_background(runner, rest: list[int]) -> threading.Thread:
    """Compiles the token buckets `rest` of the runner's step on a thread of low
    priority, each added to the runner's buckets once compiled."""
    import jax
    from tpu_inference.runner.compilation_manager import CompilationManager, _describe_signature

    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          runner.kv_caches)
    log = _log()
    # An engine in the caller's process (vllm.LLM in-process, Tunix's rollouts) shares
    # its output with the caller's script: the background's lines go to debug there.
    level = logging.DEBUG if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else logging.INFO

    def compile_now(name, fn, *args, call_kwargs={}, warmup_handler=None, **described):
        # Upstream's line for each program it precompiles, marked as ours.
        log.log(level, "Precompile %s --> %s (background)", name, _describe_signature(described))
        with jax.set_mesh(runner.mesh):
            fn.lower(*args, **call_kwargs).compile()
        if stop.is_set():  # exiting: the engine steps no more, and says nothing after
            return
        bucket = args[2].shape[0]
        runner.num_tokens_paddings_per_dp = sorted({*runner.num_tokens_paddings_per_dp, bucket})
        log.log(level, "tpu-models: token bucket %d compiled (background)", bucket)

    def run():
        # Below the engine's threads: a request waits as little as possible for the
        # cores (on Linux a thread is niced alone, and its helpers inherit it).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        began = time.perf_counter()
        for bucket in rest:  # smallest first: decodes of a few requests come first
            if stop.is_set():  # the process is exiting
                return
            view = CompilationManager.__new__(CompilationManager)
            view.runner = _RunnerView(runner, [bucket], shapes)
            view._run_compilation = compile_now
            try:
                view._precompile_backbone_text_only()
            except Exception as e:  # the bucket stays unused: steps pad past it
                log.warning("tpu-models: token bucket %d did not compile in the background "
                            "(%r); steps pad past it", bucket, e)
        if not stop.is_set():
            log.log(level, "tpu-models: all token buckets compiled (%.1f s in the background)",
                    time.perf_counter() - began)

    stop = threading.Event()
    thread = threading.Thread(target=run, name="tpu-models-buckets", daemon=True)
    thread.start()
    # At exit the bucket being compiled is finished and no other is started: a daemon
    # thread still inside XLA while the interpreter tears down aborted the process (an
    # in-process vllm.LLM, Tunix's rollouts), status 134 or 139.
    atexit.register(_stopped, stop, thread)
    return thread


def _stopped(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    thread.join()


def hashed_by_their_trees(key_class):
    """Mosaic lowering's cache key class (`key_class`), its hash also taking the pytrees
    of its parameters (a DMA's), so that a kernel's DMAs hash apart."""
    from jax.tree_util import PyTreeDef

    class PallasLoweringCacheKey(key_class):
        def __hash__(self):
            trees = tuple(str(v) for _, v in self.params if isinstance(v, PyTreeDef))
            return hash((super().__hash__(), trees))

    return PallasLoweringCacheKey


def pallas_keys_hashed_by_their_trees() -> None:
    """Mosaic lowering's cache key class, replaced by its subclass (isinstance holds)."""
    from jax._src.pallas.mosaic import lowering
    lowering.PallasLoweringCacheKey = hashed_by_their_trees(lowering.PallasLoweringCacheKey)
