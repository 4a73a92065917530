"""KV cache: its budget as asked and beside the step, and sliding-window layers' groups.

tpu-inference's worker sizes the cache from --gpu-memory-utilization alone; vLLM's
--kv-cache-memory-bytes, which the GPU and CPU workers honour, was ignored on a
TPU. It is honoured here, as off-TPU (adapt.host_portability) and in `tpu-models
compile`. The penalties' counts, which the first request asking for a penalty
allocated after the cache had taken its share, are allocated before it is sized,
and on a TPU the cache leaves the largest step the room it needs (tpu_models.memory).

tpu-inference gives every flax_nnx layer a FullAttentionSpec, so a Gemma 3 local
layer (window 512) kept the whole context. With a SlidingWindowSpec vLLM's hybrid
manager puts local and global layers in groups sharing one page pool and frees
pages that left the window; the runner hands each layer its group's block table,
which `Decoder` reads. --disable-hybrid-kv-cache-manager turns the specs back
into full ones. tpu-inference's own models are left as they are.
"""

import dataclasses

from tpu_models.adapt.guard import HYBRID_KV, KV_BUDGET, Patch, Target, our_model


def buffers_beside_the_cache(runner) -> None:
    """Allocates what the engine keeps beside the KV cache and would otherwise allocate
    later, out of the cache's room: the penalties' counts (tpu_models.sampler.counts)."""
    from tpu_inference.logger import init_logger

    from tpu_models.sampler.counts import allocate, bytes_a_chip
    slots, vocab = runner.max_num_reqs, runner.model_config.get_vocab_size()
    allocate(runner.mesh, slots, vocab)
    init_logger("tpu_models.adapt").info(
        "tpu-models: %.2f GiB a chip for the penalties' counts (%d sequences x %d ids), "
        "allocated before the KV cache is sized", bytes_a_chip(slots, vocab) / 2**30, slots,
        vocab)


def room_for_the_largest_step(worker) -> int:
    """Bytes (over the worker's chips) the cache gives up so that the largest step's
    working memory fits beside it (tpu_models.memory), logged."""
    from tpu_inference import utils
    from tpu_inference.logger import init_logger

    from tpu_models import memory
    step = memory.step_of(worker.vllm_config)
    hbm = utils.hbm_usage_bytes(worker.devices)[0][1]
    utilization = worker.cache_config.gpu_memory_utilization
    room = memory.room_beyond_utilization(step, hbm, utilization)
    init_logger("tpu_models.adapt").info(
        "tpu-models: the KV cache leaves %.2f GiB a chip for the largest step (%s over %d ids)%s",
        step.bytes / 2**30, step.what, worker.model_config.get_vocab_size(),
        f": {room / 2**30:.2f} GiB more than --gpu-memory-utilization {utilization} leaves"
        if room else "")
    return room * len(worker.devices)


def kv_cache_memory_bytes_honoured() -> None:
    from tpu_inference.logger import init_logger
    from tpu_inference.worker.tpu_worker import TPUWorker

    original = TPUWorker.determine_available_memory

    from tpu_models.host import host_platform

    def determine_available_memory(self) -> int:
        buffers_beside_the_cache(self.model_runner)
        budget = self.cache_config.kv_cache_memory_bytes
        if host_platform() is not None:  # off-TPU: the host's own sizing
            return original(self)
        if not budget:
            return original(self) - room_for_the_largest_step(self)
        init_logger("tpu_models.adapt").info(
            "tpu-models: KV cache budget %.2f GiB (--kv-cache-memory-bytes)", budget / 2**30)
        return int(budget)

    TPUWorker.determine_available_memory = determine_available_memory


def sliding_window_kv_cache_groups() -> None:
    from tpu_inference.runner.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    original = KVCacheManager.get_kv_cache_spec
    original_initialize = KVCacheManager.initialize_kv_cache

    def get_kv_cache_spec(self):
        specs = original(self)
        model_class = our_model(self.runner.vllm_config)
        if model_class is None:
            return specs
        windows = model_class.sliding_windows(self.runner.model_config.hf_text_config)
        for i, window in enumerate(windows):
            spec = specs.get(f"layer.{i}")
            if window is not None and type(spec) is FullAttentionSpec:
                specs[f"layer.{i}"] = self._create_attention_spec(
                    spec.block_size, spec.num_kv_heads, spec.head_size, sliding_window=window)
        return specs

    def initialize_kv_cache(self, kv_cache_config):
        if (len(kv_cache_config.kv_cache_groups) > 1
                and our_model(self.runner.vllm_config) is not None):
            kv_cache_config = dataclasses.replace(
                kv_cache_config, kv_cache_tensors=overlaid_tensors(kv_cache_config))
        return original_initialize(self, kv_cache_config)

    KVCacheManager.get_kv_cache_spec = get_kv_cache_spec
    KVCacheManager.initialize_kv_cache = initialize_kv_cache


def overlaid_tensors(kv_cache_config) -> list:
    """One KVCacheTensor per byte position, listing the layers (one per group) vLLM
    places there. tpu-inference overlays groups only when a group has several layers;
    with one layer per group it gave every group the whole pool, more than vLLM
    budgeted. Such a tensor it allocates once, shared."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    layers_at: dict[int, list[str]] = {}
    size = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        for j, name in enumerate(tensor.layers):
            position = tensor.offset + j * tensor.layer_stride
            layers_at.setdefault(position, []).append(name)
            size[position] = tensor.size // len(tensor.layers)  # one layer's pages
    return [KVCacheTensor(size=size[position], layers=names, layer_stride=0, block_stride=0)
            for position, names in sorted(layers_at.items())]


MANAGER = "tpu_inference.runner.kv_cache_manager.KVCacheManager"
PATCHES = [
    Patch("--kv-cache-memory-bytes honoured; the cache sized after the penalties' counts and "
          "for the largest step",
          KV_BUDGET, (
        Target("tpu_inference.worker.tpu_worker.TPUWorker.determine_available_memory", "self"),),
        "on a TPU the flag was ignored; the penalties' counts and the largest step had no room "
        "beside the cache",
        "tests/test_compile.py::test_int8_qwen3_at_tensor_parallel_4_in_the_kv_budget_asked",
        kv_cache_memory_bytes_honoured, upstream="none filed"),
    Patch("sliding-window KV cache groups", HYBRID_KV, (
        Target(f"{MANAGER}.get_kv_cache_spec", "self"),
        Target(f"{MANAGER}.initialize_kv_cache", "self kv_cache_config"),
        Target(f"{MANAGER}._create_attention_spec", "self block_size num_kv_heads head_size "
               "sliding_window")),
        "a local layer kept the whole context: 4.4x fewer tokens for Gemma 3 1B at 32K",
        "tests/test_hybrid_kv_cache.py::test_local_layers_get_their_own_kv_cache_groups",
        sliding_window_kv_cache_groups,
        upstream="tpu-inference PR 510 (flax_nnx layers get full specs by design); PR 3220"),
]
