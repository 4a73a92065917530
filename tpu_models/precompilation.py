"""What a server start compiles, and when: the policy the seam (adapt/compilation.py)
carries out and the ready line reports, the model step with the `lower` the
precompiler looks for (`AheadOfTimeStep`), and the buckets compiled after ready
(`compile_in_background`)."""

import atexit
import contextlib
import logging
import os
import threading
import time


def background_buckets(vllm_config) -> bool:
    """Whether token buckets compile after the server is ready: off-TPU, when it
    precompiles at all, for a plain text model on one rank (LoRA slots, drafts,
    pipeline and data parallel ranks each add programs a bucket depends on). Not across
    hosts: each host would pad a step to the buckets it had compiled by then, and
    hosts running different programs break each other's collectives."""
    from tpu_inference import envs

    from tpu_models.host import host_platform
    from tpu_models.multihost import serving_across_hosts

    parallel = vllm_config.parallel_config
    return (host_platform() is not None and not envs.SKIP_JAX_PRECOMPILE
            and not serving_across_hosts()
            and not vllm_config.model_config.enforce_eager and vllm_config.lora_config is None
            and vllm_config.speculative_config is None
            and not vllm_config.model_config.is_multimodal_model
            and parallel.pipeline_parallel_size == 1 and parallel.data_parallel_size == 1)


def ready_buckets(paddings: list[int]) -> list[int]:
    """Compiled before the server is ready: the smallest bucket (one decode) and the
    largest (any prompt, chunk by chunk). Until the others compile, a step pads to
    the next of these."""
    return sorted({paddings[0], paddings[-1]})


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
    from tpu_inference.logger import init_logger
    from tpu_inference.runner.compilation_manager import CompilationManager, _describe_signature

    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          runner.kv_caches)
    log = init_logger("tpu_models.adapt")
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
