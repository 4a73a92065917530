"""vLLM's engine and loader around a flax model: what they assume of a PyTorch one."""

from tpu_models.adapt.guard import IN_PROCESS, LOG, START_CHECKS, Patch, Target


def model_paths_checked() -> None:
    # Plain `vllm serve ./missing`: huggingface_hub's error about repository ids, after
    # hundreds of lines. Only the path: a caller may set load_format after building
    # the arguments (Tunix's VllmSampler builds EngineArgs(model=...) for defaults).
    from vllm.engine.arg_utils import EngineArgs

    from tpu_models.loaders.paths import model_path_problem

    original = EngineArgs.__post_init__

    def __post_init__(self):
        # Before vLLM resolves MODEL (offline: through huggingface_hub, here); a name
        # that is not a path ("gpt2", "org/name") is the hub's to answer.
        model = str(self.model)
        problem = (model.startswith(("/", ".", "~"))
                   and model_path_problem(model, dummy_weights=True))
        if problem:
            raise ValueError(problem)
        return original(self)

    EngineArgs.__post_init__ = __post_init__


def weight_loading_timed() -> None:
    # vLLM starts the clock when its own safetensors iterator is first read, which
    # our models (reading the checkpoint themselves) never do: it logged the uptime.
    import time

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights

    def load_weights(self, model, model_config):
        if not self.counter_before_loading_weights:
            self.counter_before_loading_weights = time.perf_counter()
        return original(self, model, model_config)

    DefaultModelLoader.load_weights = load_weights


def gloo_lines_dropped() -> None:
    # torch's gloo prints "[Gloo] Rank 0 is connected to 0 peer ranks" from C++ for
    # each of the seven groups vLLM's distributed start-up makes, at any log level.
    from tpu_inference.worker.tpu_worker import TPUWorker

    from tpu_models import logs

    original = TPUWorker.init_device

    def init_device(self, *args, **kwargs):
        with logs.stdout_without(logs.GLOO_CONNECTED):
            return original(self, *args, **kwargs)

    TPUWorker.init_device = init_device


def engine_cleanup_of_torch_models_only() -> None:
    # The engine walks the runner's model as a torch module to drop torch.compile
    # hooks; a flax model has neither `modules()` nor such hooks.
    from vllm.v1.engine.llm_engine import LLMEngine

    original = LLMEngine._cleanup_instance_caches

    def cleanup(model_ref):
        if hasattr(model_ref(), "modules"):
            original(model_ref)

    LLMEngine._cleanup_instance_caches = staticmethod(cleanup)


PATCHES = [
    Patch("weight-loading clock started at loading",
          LOG, (Target("vllm.model_executor.model_loader.default_loader.DefaultModelLoader"
                       ".load_weights", "self model model_config"), ),
          "'Loading weights took N seconds' logged the host's uptime",
          "tests/test_startup_log.py::test_demo_server_log_tells_the_truth", weight_loading_timed),
    Patch("model paths checked before vLLM resolves them", START_CHECKS, (
          Target("vllm.engine.arg_utils.EngineArgs.__post_init__", "self"), ),
          "`vllm serve ./missing` ended in huggingface_hub's error about repository ids",
          "tests/test_startup_checks.py::test_plain_vllm_serve_names_a_missing_model_directory",
          model_paths_checked),
    Patch("gloo's connection lines dropped", LOG, (
          Target("tpu_inference.worker.tpu_worker.TPUWorker.init_device",
                 "self tpu_process_bounds tpu_chips_per_process_bounds tpu_visible_chips"), ),
          "seven '[Gloo] Rank 0 is connected to 0 peer ranks' lines in every healthy log",
          "tests/test_startup_log.py::test_demo_server_log_tells_the_truth", gloo_lines_dropped),
    Patch("engine clean-up skips flax models",
          IN_PROCESS, (Target("vllm.v1.engine.llm_engine.LLMEngine._cleanup_instance_caches",
                              "model_ref"), ),
          "an in-process vllm.LLM ended in an AttributeError traceback",
          "tests/test_adapt.py::test_an_in_process_engine_exits_without_a_traceback",
          engine_cleanup_of_torch_models_only),
]
