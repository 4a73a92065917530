"""vLLM's engine and loader around a flax model: what they assume of a PyTorch one."""

from tpu_models.features import IN_PROCESS, LOG, START_CHECKS
from tpu_models.patching import Patch, Target


def post_init_after_the_path_check(original, self):
    """EngineArgs.__post_init__: a missing model directory named before vLLM resolves
    MODEL (plain `vllm serve ./missing` ended in huggingface_hub's error about
    repository ids). Only the path: a caller may set load_format afterwards (Tunix's
    VllmSampler builds EngineArgs(model=...) for defaults)."""
    from tpu_models.loaders.paths import model_path_problem
    model = str(self.model)  # a name that is not a path ("org/name") is the hub's
    if model.startswith(("/", ".", "~")) and (problem := model_path_problem(model,
                                                                          dummy_weights=True)):
        raise ValueError(problem)
    return original(self)


def load_weights_timed(original, self, model, model_config):
    """DefaultModelLoader.load_weights: vLLM starts its clock when its own safetensors
    iterator is first read, which our models never do (it logged the uptime)."""
    import time
    if not self.counter_before_loading_weights:
        self.counter_before_loading_weights = time.perf_counter()
    return original(self, model, model_config)


def init_device_without_gloo_lines(original, self, *args, **kwargs):
    """TPUWorker.init_device: torch's gloo prints "[Gloo] Rank 0 is connected to 0 peer
    ranks" from C++ for each of the seven groups vLLM's start-up makes."""
    from tpu_models import logs
    with logs.stdout_without(logs.GLOO_CONNECTED):
        return original(self, *args, **kwargs)


def cleanup_of_torch_models_only(original, model_ref):
    """LLMEngine._cleanup_instance_caches walks the model as a torch module (to drop
    torch.compile hooks); a flax model has neither `modules()` nor such hooks."""
    if hasattr(model_ref(), "modules"):
        original(model_ref)


PATCHES = [
    Patch("weight-loading clock started at loading", LOG, (
          Target("vllm.model_executor.model_loader.default_loader.DefaultModelLoader"
                 ".load_weights", "self model model_config", load_weights_timed), ),
          "'Loading weights took N seconds' logged the host's uptime",
          "tests/test_startup_log.py::test_demo_server_log_tells_the_truth"),
    Patch("model paths checked before vLLM resolves them", START_CHECKS, (
          Target("vllm.engine.arg_utils.EngineArgs.__post_init__", "self",
                 post_init_after_the_path_check), ),
          "`vllm serve ./missing` ended in huggingface_hub's error about repository ids",
          "tests/test_startup_checks.py::test_plain_vllm_serve_names_a_missing_model_directory"),
    Patch("gloo's connection lines dropped", LOG, (
          Target("tpu_inference.worker.tpu_worker.TPUWorker.init_device",
                 "self tpu_process_bounds tpu_chips_per_process_bounds tpu_visible_chips",
                 init_device_without_gloo_lines), ),
          "seven '[Gloo] Rank 0 is connected to 0 peer ranks' lines in every healthy log",
          "tests/test_startup_log.py::test_demo_server_log_tells_the_truth"),
    Patch("engine clean-up skips flax models", IN_PROCESS, (
          Target("vllm.v1.engine.llm_engine.LLMEngine._cleanup_instance_caches", "model_ref",
                 cleanup_of_torch_models_only), ),
          "an in-process vllm.LLM ended in an AttributeError traceback",
          "tests/test_adapt.py::test_an_in_process_engine_exits_without_a_traceback"),
]
