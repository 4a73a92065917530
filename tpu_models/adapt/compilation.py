"""Precompilation: what a start compiles, and when.

tpu-inference compiles the model step once per token bucket before it serves,
but only functions with a `lower` take part in its parallel ahead-of-time pass:
the flax step is a Python function that picks a jit, so each bucket was traced,
compiled (or read back from JAX's cache) and run once, one after another. Here
the step lowers ahead of time, and a bucket compiled that way is not also run.
Off-TPU the buckets between the smallest and the largest then compile in the
background once the server is ready; until one is compiled, a step pads to the
next compiled bucket. Figures: benchmarks/README.md (bench startup).
"""

from tpu_models.adapt import state
from tpu_models.adapt.guard import OFF_TPU, STARTUP, Patch, Target
from tpu_models.precompilation import (AheadOfTimeStep, background_buckets, compile_in_background,
                                       ready_buckets)

LOADER = "tpu_inference.models.common.model_loader"
MANAGER = "tpu_inference.runner.compilation_manager.CompilationManager"


def _logger():
    from tpu_inference.logger import init_logger
    return init_logger("tpu_models.adapt")


upstream: dict = {}  # the functions the replacements below call


def step_lowered_ahead_of_time() -> None:
    from tpu_inference.models.common import model_loader

    upstream["get_flax_model"] = model_loader.get_flax_model
    model_loader.get_flax_model = get_flax_model


def get_flax_model(vllm_config, rng, mesh, is_draft_model=False):
    """model_loader.get_flax_model: its step with the `lower` the precompiler looks for."""
    import dataclasses
    interface = upstream["get_flax_model"](vllm_config, rng, mesh, is_draft_model)
    step = AheadOfTimeStep.wrap(interface.model_fn)
    if step is None:
        _logger().warning("tpu-models: the model step cannot be lowered ahead of time on "
                          "this tpu-inference; each bucket compiles in the warm-up pass")
        return interface
    return dataclasses.replace(interface, model_fn=step)


def compiled_functions_not_run() -> None:
    # The warm-up pass calls every precompiled function once, to fill the caches of
    # functions it could not lower. One compiled ahead is in jit's caches already,
    # and its call was pure cost: a forward pass per bucket of the step (4 s at 256
    # tokens for a 0.6B model on CPU), the sampler at 64 rows of a 152k vocabulary.
    from tpu_inference.runner.compilation_manager import CompilationManager

    upstream.update(run=CompilationManager._run_compilation,
                    flush=CompilationManager._flush_compilations)
    CompilationManager._run_compilation = _run_compilation
    CompilationManager._flush_compilations = _flush_compilations


def _run_compilation(self, name, fn, *args, **kwargs):
    """CompilationManager._run_compilation, noting a task compiling on a worker."""
    tasks, futures = len(self._warmup_tasks), len(self._compile_futures)
    upstream["run"](self, name, fn, *args, **kwargs)
    if len(self._warmup_tasks) > tasks and len(self._compile_futures) > futures:
        state.of(self.runner).compiled_ahead.add(id(self._warmup_tasks[-1]))


def _flush_compilations(self):
    """CompilationManager._flush_compilations: warm-up calls of functions compiled
    ahead left out."""
    ahead = state.of(self.runner).compiled_ahead
    tasks = self._warmup_tasks
    self._warmup_tasks = [task for task in tasks if id(task) not in ahead]
    ahead.clear()
    return upstream["flush"](self)  # waits for the workers' compilations, raising their errors


def _deferring(runner) -> bool:
    return (isinstance(runner.model_fn, AheadOfTimeStep) and runner.dp_size == 1
            and background_buckets(runner.vllm_config))


def buckets_after_ready() -> None:
    from tpu_inference.runner.compilation_manager import CompilationManager

    upstream.update(capture=CompilationManager.capture_model,
                    backbone=CompilationManager._precompile_backbone_text_only)
    CompilationManager._precompile_backbone_text_only = _precompile_backbone_text_only
    CompilationManager.capture_model = capture_model


def _precompile_backbone_text_only(self):
    """CompilationManager._precompile_backbone_text_only: while capture_model runs
    off-TPU, the buckets compiled before ready only."""
    runner = self.runner
    plan = state.of(runner).ready_buckets
    if plan is None:
        return upstream["backbone"](self)
    every = runner.num_tokens_paddings
    runner.num_tokens_paddings = plan
    try:
        return upstream["backbone"](self)
    finally:
        runner.num_tokens_paddings = every


def capture_model(self):
    """CompilationManager.capture_model: off-TPU, the smallest and largest buckets
    before ready, the others in the background (precompilation.compile_in_background)."""
    runner = self.runner
    if not _deferring(runner):
        return upstream["capture"](self)
    every = list(runner.num_tokens_paddings)
    seam = state.of(runner)
    seam.ready_buckets, seam.overlapped = ready_buckets(every), True  # compiles_overlapped
    try:
        upstream["capture"](self)  # its flushes wait for nothing; its end waits for the workers
    finally:
        seam.ready_buckets, seam.overlapped = None, False
    self._flush_compilations()  # raises the workers' errors, runs the warm-up calls
    rest = [b for b in every if b not in ready_buckets(every)]
    if rest:
        runner.num_tokens_paddings_per_dp = ready_buckets(every)
        _logger().info("tpu-models: token buckets %s compiled; %s compile in the background "
                       "(until then a step pads to the next compiled one)",
                       ready_buckets(every), rest)
        seam.background = compile_in_background(runner, rest)


def compiles_overlapped() -> None:
    # tpu-inference waits for each group's compilations before it lowers the next,
    # and precompiles the sampler before the KV cache exists (to keep HBM free for
    # it). Off-TPU both only serialize: the sampler at every request bucket (2 s
    # at 0.6B, read back from the cache) ran before the step's buckets, and each
    # group waited for the step's largest bucket (3 s). Here the sampler waits for
    # capture_model, whose flushes then wait for nothing: the main thread lowers
    # every group while the workers compile, and capture_model's end waits for all.
    from tpu_inference.runner.compilation_manager import CompilationManager

    upstream.update(sampling=CompilationManager._precompile_sampling,
                    gather=CompilationManager._precompile_gather_logprobs,
                    flush_when_not_overlapped=CompilationManager._flush_compilations)
    CompilationManager._precompile_sampling = _precompile_sampling
    CompilationManager._precompile_gather_logprobs = _precompile_gather_logprobs
    CompilationManager._flush_compilations = _flush_unless_overlapped


def _after_capture(self) -> bool:
    """Whether capture_model precompiles this later (its flag stays unset)."""
    return _deferring(self.runner) and not self.runner.kv_caches


def _precompile_sampling(self):
    """CompilationManager._precompile_sampling, off-TPU after capture_model."""
    return None if _after_capture(self) else upstream["sampling"](self)


def _precompile_gather_logprobs(self):
    """CompilationManager._precompile_gather_logprobs, off-TPU after capture_model."""
    return None if _after_capture(self) else upstream["gather"](self)


def _flush_unless_overlapped(self):
    """CompilationManager._flush_compilations: waits for nothing inside capture_model."""
    if state.of(self.runner).overlapped:
        return None
    return upstream["flush_when_not_overlapped"](self)


def unfused_programs_at_first_use() -> None:
    # Off-TPU, with EAGLE-3 steps fused (adapt.spec_fusion), upstream's speculative
    # programs (rejection samplers, row selections, the draft's passes: 290 of the
    # demo's 370) run only in the steps the fused one leaves them (logprobs, penalties).
    from tpu_inference.runner.compilation_manager import CompilationManager

    upstream["speculative"] = CompilationManager._precompile_speculative_decoding
    CompilationManager._precompile_speculative_decoding = _precompile_speculative_decoding


def _precompile_speculative_decoding(self):
    """CompilationManager._precompile_speculative_decoding: not where steps fuse."""
    from tpu_models.adapt import spec_fusion
    if not spec_fusion.fuses(self.runner):
        return upstream["speculative"](self)
    _logger().info("tpu-models: EAGLE-3's unfused programs (for steps with logprobs or "
                   "penalties) compile when a step first needs them")


def pallas_keys_hashed_by_their_trees() -> None:
    # Mosaic lowering caches each kernel equation under a key whose hash takes a DMA's
    # pytree without its nodes' data: a kernel's DMAs all hash alike, and each lookup
    # compared keys in full (RPA v3: a million comparisons, 2.5 of 8.8 s a lowering).
    from jax._src.pallas.mosaic import lowering
    from jax.tree_util import PyTreeDef

    class PallasLoweringCacheKey(lowering.PallasLoweringCacheKey):
        def __hash__(self):
            trees = tuple(str(v) for _, v in self.params if isinstance(v, PyTreeDef))
            return hash((super().__hash__(), trees))

    lowering.PallasLoweringCacheKey = PallasLoweringCacheKey


_STEP = "self"
_RUN = "self name fn args call_kwargs warmup_handler aot compile_only kwargs"
_PALLAS_KEY = ("primitive kernel_type avals_in avals_out params block_shapes grid_arity "
               "forward_compatible fuse_transposed_lhs_in_matmul grid_sizes vmapped_dims "
               "dynamic_shape_env")
PATCHES = [
    Patch("model step lowered ahead of time", STARTUP, (
        Target(f"{LOADER}.get_flax_model", "vllm_config rng mesh is_draft_model"),
        Target(f"{MANAGER}._run_compilation", _RUN)),
        "each token bucket of the step compiled one after another, in the warm-up pass",
        "tests/test_startup.py::test_a_restart_compiles_nothing_and_serves_every_bucket",
        step_lowered_ahead_of_time, speed="tpu-models bench startup"),
    Patch("functions compiled ahead not run in the warm-up pass", STARTUP, (
        Target(f"{MANAGER}._run_compilation", _RUN),
        Target(f"{MANAGER}._flush_compilations", _STEP)),
        "the warm-up pass ran a forward pass per bucket (4 s at 256 tokens, 0.6B on CPU)",
        "tests/test_startup.py::test_a_restart_compiles_nothing_and_serves_every_bucket",
        compiled_functions_not_run, speed="tpu-models bench startup"),
    Patch("token buckets compiled after ready", STARTUP, (
        Target(f"{MANAGER}.capture_model", _STEP),
        Target(f"{MANAGER}._precompile_backbone_text_only", _STEP),
        Target("tpu_inference.runner.compilation_manager._describe_signature", "kwargs")),
        "a CPU host compiled every bucket before serving (0.6B, cold: 8 s each)",
        "tests/test_startup.py::test_a_restart_compiles_nothing_and_serves_every_bucket",
        buckets_after_ready, platform=OFF_TPU, speed="tpu-models bench startup"),
    Patch("precompilation overlapped with the workers", STARTUP, (
        Target(f"{MANAGER}._precompile_sampling", _STEP),
        Target(f"{MANAGER}._precompile_gather_logprobs", _STEP),
        Target(f"{MANAGER}._flush_compilations", _STEP),
        Target(f"{MANAGER}.capture_model", _STEP)),
        "the sampler and each group of functions waited for the step's largest bucket",
        "tests/test_startup.py::test_a_restart_compiles_nothing_and_serves_every_bucket",
        compiles_overlapped, platform=OFF_TPU, speed="tpu-models bench startup"),
    Patch("EAGLE-3's unfused programs compiled at first use", STARTUP, (
        Target(f"{MANAGER}._precompile_speculative_decoding", _STEP), ),
        "a CPU host compiled ~290 programs before serving that fused EAGLE-3 steps never run",
        "tests/test_spec_fusion.py::test_fused_eagle3_steps_give_the_text_of_plain_decoding",
        unfused_programs_at_first_use, platform=OFF_TPU, speed="tpu-models bench startup"),
    Patch("Pallas lowering's cache keys hashed by their DMAs' trees", STARTUP, (
        Target("jax._src.pallas.mosaic.lowering.PallasLoweringCacheKey", _PALLAS_KEY), ),
        "every lookup of a kernel's DMA compared the keys of all its DMAs in full",
        "tests/test_compile.py::test_pallas_lowering_keys_of_different_dmas_hash_apart",
        pallas_keys_hashed_by_their_trees, speed="tpu-models bench compile"),
]
