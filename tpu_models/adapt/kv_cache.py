"""KV cache: its budget as asked and beside the step, and sliding-window layers' groups."""

from tpu_models import kv_cache
from tpu_models.features import HYBRID_KV, KV_BUDGET
from tpu_models.patching import Patch, Target
from tpu_models.registry import our_model


def available_memory_as_asked(original, self) -> int:
    """TPUWorker.determine_available_memory: the penalties' counts allocated first; on a
    TPU the cache's budget as asked, or upstream's less the largest step's room."""
    return kv_cache.available_memory(original, self)


def specs_with_sliding_windows(original, self):
    """KVCacheManager.get_kv_cache_spec: our models' sliding-window layers' own specs."""
    model_class = our_model(self.runner.vllm_config)
    if model_class is None:
        return original(self)
    windows = model_class.sliding_windows(self.runner.model_config.hf_text_config)
    return kv_cache.with_sliding_windows(original(self), windows, self._create_attention_spec)


def groups_overlaid(original, self, kv_cache_config):
    """KVCacheManager.initialize_kv_cache: our models' groups share one page pool."""
    if (len(kv_cache_config.kv_cache_groups) > 1
            and our_model(self.runner.vllm_config) is not None):
        kv_cache_config = kv_cache.with_groups_overlaid(kv_cache_config)
    return original(self, kv_cache_config)


MANAGER = "tpu_inference.runner.kv_cache_manager.KVCacheManager"
PATCHES = [
    Patch("--kv-cache-memory-bytes honoured; the cache sized after the penalties' counts and "
          "for the largest step",
          KV_BUDGET, (
        Target("tpu_inference.worker.tpu_worker.TPUWorker.determine_available_memory", "self",
               available_memory_as_asked), ),
        "on a TPU the flag was ignored; the penalties' counts and the largest step had no room "
        "beside the cache",
        "tests/test_compile.py::test_int8_qwen3_at_tensor_parallel_4_in_the_kv_budget_asked",
        upstream="none filed"),
    Patch("sliding-window KV cache groups", HYBRID_KV, (
        Target(f"{MANAGER}.get_kv_cache_spec", "self", specs_with_sliding_windows),
        Target(f"{MANAGER}.initialize_kv_cache", "self kv_cache_config", groups_overlaid),
        Target(f"{MANAGER}._create_attention_spec", "self block_size num_kv_heads head_size "
               "sliding_window")),
        "a local layer kept the whole context: 4.4x fewer tokens for Gemma 3 1B at 32K",
        "tests/test_hybrid_kv_cache.py::test_local_layers_get_their_own_kv_cache_groups",
        upstream="tpu-inference PR 510 (flax_nnx layers get full specs by design); PR 3220"),
]
