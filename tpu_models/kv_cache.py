"""The KV cache: its budget as asked and beside the step, and sliding-window layers' groups.

tpu-inference's worker sizes the cache from --gpu-memory-utilization alone; vLLM's
--kv-cache-memory-bytes, which the GPU and CPU workers honour, was ignored on a
TPU. The seam (adapt.kv_cache) honours it there, as off-TPU (off_tpu.kv_cache_budget)
and in `tpu-models compile`. The penalties' counts, which the first request asking
for a penalty allocated after the cache had taken its share, are allocated before it
is sized (`allocate_beside_the_cache`, by `available_memory`), and on a TPU the cache leaves the largest step
the room it needs (`room_for_the_largest_step`, by tpu_models.memory's arithmetic).

tpu-inference gives every flax_nnx layer a FullAttentionSpec, so a Gemma 3 local
layer (window 512) kept the whole context. With a SlidingWindowSpec
(`with_sliding_windows`) vLLM's hybrid manager puts local and global layers in
groups sharing one page pool and frees pages that left the window; the runner hands
each layer its group's block table, which `Decoder` reads. --disable-hybrid-kv-cache-manager
turns the specs back into full ones. tpu-inference's own models are left as they are.
"""

import dataclasses


def _log():
    from tpu_inference.logger import init_logger
    return init_logger("tpu_models.adapt")


def allocate_beside_the_cache(runner) -> None:
    """Allocates what the engine keeps beside the KV cache and would otherwise allocate
    later, out of the cache's room: the penalties' counts (tpu_models.sampler.counts)."""
    from tpu_models.sampler.counts import allocate, bytes_a_chip
    slots, vocab = runner.max_num_reqs, runner.model_config.get_vocab_size()
    allocate(runner.mesh, slots, vocab)
    _log().info(
        "tpu-models: %.2f GiB a chip for the penalties' counts (%d sequences x %d ids), "
        "allocated before the KV cache is sized", bytes_a_chip(slots, vocab) / 2**30, slots,
        vocab)


def available_memory(determine, worker) -> int:
    """The KV cache's budget on tpu-inference's TPUWorker `worker` (`determine`: its
    determine_available_memory): the penalties' counts allocated first; on a TPU the
    budget as asked, or `determine`'s less the largest step's room."""
    from tpu_models.host import host_platform
    allocate_beside_the_cache(worker.model_runner)
    if host_platform() is not None:  # off-TPU: the host's own sizing
        return determine(worker)
    if budget := worker.cache_config.kv_cache_memory_bytes:
        return budget_asked(budget)
    return determine(worker) - room_for_the_largest_step(worker)


def budget_asked(budget: int) -> int:
    """--kv-cache-memory-bytes, as the cache's budget (logged)."""
    _log().info("tpu-models: KV cache budget %.2f GiB (--kv-cache-memory-bytes)", budget / 2**30)
    return int(budget)


def room_for_the_largest_step(worker) -> int:
    """Bytes (over the worker's chips) the cache gives up so that the largest step's
    working memory fits beside it (tpu_models.memory), logged."""
    from tpu_inference import utils

    from tpu_models import memory
    step = memory.step_of(worker.vllm_config)
    hbm = utils.hbm_usage_bytes(worker.devices)[0][1]
    utilization = worker.cache_config.gpu_memory_utilization
    room = memory.room_beyond_utilization(step, hbm, utilization)
    _log().info(
        "tpu-models: the KV cache leaves %.2f GiB a chip for the largest step (%s over %d ids)%s",
        step.bytes / 2**30, step.what, worker.model_config.get_vocab_size(),
        f": {room / 2**30:.2f} GiB more than --gpu-memory-utilization {utilization} leaves"
        if room else "")
    return room * len(worker.devices)


def with_sliding_windows(specs: dict, windows: list[int | None], attention_spec) -> dict:
    """The runner's KV-cache specs (layer name -> spec), a sliding-window layer's full
    one made a sliding-window one by `attention_spec` (the manager's
    _create_attention_spec); each layer's window from the model's `sliding_windows`."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    for i, window in enumerate(windows):
        spec = specs.get(f"layer.{i}")
        if window is not None and type(spec) is FullAttentionSpec:
            specs[f"layer.{i}"] = attention_spec(
                spec.block_size, spec.num_kv_heads, spec.head_size, sliding_window=window)
    return specs


def with_groups_overlaid(kv_cache_config):
    """vLLM's KVCacheConfig with one KVCacheTensor per byte position, listing the
    layers (one per group) vLLM places there. tpu-inference overlays groups only when a
    group has several layers; with one layer per group it gave every group the whole
    pool, more than vLLM budgeted. Such a tensor it allocates once, shared."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    layers_at: dict[int, list[str]] = {}
    size = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        for j, name in enumerate(tensor.layers):
            position = tensor.offset + j * tensor.layer_stride
            layers_at.setdefault(position, []).append(name)
            size[position] = tensor.size // len(tensor.layers)  # one layer's pages
    tensors = [KVCacheTensor(size=size[position], layers=names, layer_stride=0, block_stride=0)
               for position, names in sorted(layers_at.items())]
    return dataclasses.replace(kv_cache_config, kv_cache_tensors=tensors)
