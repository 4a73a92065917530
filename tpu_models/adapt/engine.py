"""vLLM's engine and loader around a flax model: what they assume of a PyTorch one."""

from tpu_models.adapt.guard import IN_PROCESS, LOG, Patch, Target


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
    Patch("engine clean-up skips flax models",
          IN_PROCESS, (Target("vllm.v1.engine.llm_engine.LLMEngine._cleanup_instance_caches",
                              "model_ref"), ),
          "an in-process vllm.LLM ended in an AttributeError traceback",
          "tests/test_adapt.py::test_an_in_process_engine_exits_without_a_traceback",
          engine_cleanup_of_torch_models_only),
]
