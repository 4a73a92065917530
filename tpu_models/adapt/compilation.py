"""Precompilation: what a start compiles, and when."""

from tpu_models import precompilation
from tpu_models.adapt import state
from tpu_models.features import STARTUP
from tpu_models.patching import OFF_TPU, Patch, Target


def step_lowered_ahead_of_time(original, vllm_config, rng, mesh, is_draft_model=False):
    """model_loader.get_flax_model: its step with the `lower` the precompiler looks for."""
    return precompilation.with_the_step_lowered_ahead(original(vllm_config, rng, mesh,
                                                               is_draft_model))


def compiled_ahead_noted(original, self, name, fn, *args, **kwargs):
    """CompilationManager._run_compilation, noting a task compiling on a worker."""
    ahead = state.of(self.runner).compiled_ahead
    with precompilation.noting_a_task_compiled_ahead(self, ahead):
        original(self, name, fn, *args, **kwargs)


def flush_of_what_is_left(original, self):
    """CompilationManager._flush_compilations: inside capture_model off-TPU it waits for
    nothing; warm-up calls of functions compiled ahead are left out."""
    seam = state.of(self.runner)
    if seam.overlapped:
        return None
    self._warmup_tasks = precompilation.warm_up_tasks_to_run(self._warmup_tasks,
                                                            seam.compiled_ahead)
    return original(self)  # waits for the workers' compilations, raising their errors


def ready_buckets_only(original, self):
    """CompilationManager._precompile_backbone_text_only: while capture_model runs
    off-TPU, the buckets compiled before ready only."""
    with precompilation.buckets_of(self.runner, state.of(self.runner).ready_buckets):
        return original(self)


def ready_buckets_first(original, self):
    """CompilationManager.capture_model: off-TPU, the smallest and largest buckets
    before ready, the others in the background."""
    if not precompilation.deferring(self.runner):
        return original(self)
    seam, every = state.of(self.runner), list(self.runner.num_tokens_paddings)
    seam.ready_buckets, seam.overlapped = precompilation.ready_buckets(every), True
    try:
        original(self)  # its flushes wait for nothing; its end waits for the workers
    finally:
        seam.ready_buckets, seam.overlapped = None, False
    self._flush_compilations()  # raises the workers' errors, runs the warm-up calls
    seam.background = precompilation.rest_in_background(self.runner, every)


def after_capture_model(original, self):
    """CompilationManager._precompile_sampling and _precompile_gather_logprobs: off-TPU,
    left to capture_model, which precompiles them after the KV cache (their flags unset)."""
    if precompilation.deferring(self.runner) and not self.runner.kv_caches:
        return None
    return original(self)


def unfused_at_first_use(original, self):
    """CompilationManager._precompile_speculative_decoding: not where steps fuse."""
    from tpu_models.adapt import spec_fusion
    if not spec_fusion.fuses(self.runner):
        return original(self)
    precompilation.unfused_programs_at_first_use()


LOADER = "tpu_inference.models.common.model_loader"
MANAGER = "tpu_inference.runner.compilation_manager.CompilationManager"
_RUN = "self name fn args call_kwargs warmup_handler aot compile_only kwargs"
_PALLAS_KEY = ("primitive kernel_type avals_in avals_out params block_shapes grid_arity "
               "forward_compatible fuse_transposed_lhs_in_matmul grid_sizes vmapped_dims "
               "dynamic_shape_env")
PATCHES = [
    Patch("model step lowered ahead of time", STARTUP, (
        Target(f"{LOADER}.get_flax_model", "vllm_config rng mesh is_draft_model",
               step_lowered_ahead_of_time),
        Target(f"{MANAGER}._run_compilation", _RUN)),
        "each token bucket of the step compiled one after another, in the warm-up pass",
        "tests/test_startup.py::test_a_restart_compiles_nothing_and_serves_every_bucket",
        speed="tpu-models bench startup"),
    Patch("functions compiled ahead not run in the warm-up pass", STARTUP, (
        Target(f"{MANAGER}._run_compilation", _RUN, compiled_ahead_noted),
        Target(f"{MANAGER}._flush_compilations", "self", flush_of_what_is_left)),
        "the warm-up pass ran a forward pass per bucket (4 s at 256 tokens, 0.6B on CPU)",
        "tests/test_startup.py::test_a_restart_compiles_nothing_and_serves_every_bucket",
        speed="tpu-models bench startup"),
    Patch("token buckets compiled after ready", STARTUP, (
        Target(f"{MANAGER}.capture_model", "self", ready_buckets_first),
        Target(f"{MANAGER}._precompile_backbone_text_only", "self", ready_buckets_only),
        Target("tpu_inference.runner.compilation_manager._describe_signature", "kwargs")),
        "a CPU host compiled every bucket before serving (0.6B, cold: 8 s each)",
        "tests/test_startup.py::test_a_restart_compiles_nothing_and_serves_every_bucket",
        platform=OFF_TPU, speed="tpu-models bench startup"),
    Patch("precompilation overlapped with the workers", STARTUP, (
        Target(f"{MANAGER}._precompile_sampling", "self", after_capture_model),
        Target(f"{MANAGER}._precompile_gather_logprobs", "self", after_capture_model),
        Target(f"{MANAGER}._flush_compilations", "self"),  # flush_of_what_is_left
        Target(f"{MANAGER}.capture_model", "self")),
        "the sampler and each group of functions waited for the step's largest bucket",
        "tests/test_startup.py::test_a_restart_compiles_nothing_and_serves_every_bucket",
        platform=OFF_TPU, speed="tpu-models bench startup"),
    Patch("EAGLE-3's unfused programs compiled at first use", STARTUP, (
        Target(f"{MANAGER}._precompile_speculative_decoding", "self", unfused_at_first_use), ),
        "a CPU host compiled ~290 programs before serving that fused EAGLE-3 steps never run",
        "tests/test_spec_fusion.py::test_fused_eagle3_steps_give_the_text_of_plain_decoding",
        platform=OFF_TPU, speed="tpu-models bench startup"),
    Patch("Pallas lowering's cache keys hashed by their DMAs' trees", STARTUP, (
        Target("jax._src.pallas.mosaic.lowering.PallasLoweringCacheKey", _PALLAS_KEY), ),
        "every lookup of a kernel's DMA compared the keys of all its DMAs in full",
        "tests/test_compile.py::test_pallas_lowering_keys_of_different_dmas_hash_apart",
        precompilation.pallas_keys_hashed_by_their_trees, speed="tpu-models bench compile"),
]
