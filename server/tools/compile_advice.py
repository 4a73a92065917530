"""What would fit, when a configuration does not: worked out from the abstract engine.

`tpu-models compile` stops at the first memory check that fails (the worker's
HBM budget, vLLM's KV-cache check, or the TPU compiler itself). Each line here
estimates one change a user can make, from the sizes the compile already knows:
the weights per chip (their abstract buffers), the KV cache's bytes per token
per chip (the worker's KV-cache specs, as tpu-inference lays the cache out, fp8
packing included) and the chip's HBM. They are estimates, to be checked by
compiling again with the change.
"""

import math
import re

from tpu_models.adapt import topology as abstract, topology_programs as programs_
from tpu_models.topologies import TOPOLOGIES


# Buffers a chip holds before the KV cache is allocated (adapt.topology's labels).
RESIDENT = ("weights", "draft weights", "host inputs")
# libtpu's refusal of a program: "... HLO temporaries (19.75G) exceeds available HBM (15.75G)"
COMPILER_HBM = re.compile(r"\((?P<required>[\d.]+)G\) exceeds available HBM \((?P<available>[\d.]+)G\)")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def kv_bytes_per_token(runner, dtype=None) -> tuple[float, float]:
    """(full-attention, sliding-window) KV bytes per token, on one chip, summed over
    layers; `dtype` (a torch dtype) lays the cache out in that type instead."""
    from tpu_inference import utils
    from tpu_inference.layers.common.sharding import ShardingAxisName
    from tpu_inference.runner.kv_cache import get_attention_page_size_bytes

    shards = utils.get_mesh_shape_product(runner.mesh, ShardingAxisName.KV_HEAD)
    full = sliding = 0.0
    for spec in runner.get_kv_cache_spec().values():
        page = spec.page_size_bytes if dtype is None else get_attention_page_size_bytes(
            runner.mesh, spec.block_size, spec.num_kv_heads, spec.head_size, dtype, False,
            getattr(runner, "attention_backend", None))
        per_token = page / spec.block_size / shards
        if getattr(spec, "sliding_window", None):
            sliding += per_token
        else:
            full += per_token
    return full, sliding


def _request_bytes(per_token: tuple[float, float], length: int, window: int) -> float:
    full, sliding = per_token
    return full * length + sliding * min(length, window)


def _window(runner) -> int:
    return max((getattr(s, "sliding_window", 0) or 0
                for s in runner.get_kv_cache_spec().values()), default=0)


def _quantizable_bytes(runner) -> int:
    """Bytes per chip of the projection weights Qwix presets quantize (`*_proj`)."""
    from flax import nnx
    total = 0
    for path, x in nnx.to_flat_state(runner.state):
        value = getattr(x, "value", x)
        if any(str(p).endswith("_proj") for p in path) and hasattr(value, "sharding"):
            total += math.prod(value.sharding.shard_shape(value.shape)) * value.dtype.itemsize
    return total


def what_would_fit(vllm_config, message: str, excess: float = 0) -> list[str]:
    """One line per change estimated to make this configuration fit; `excess`: the
    bytes a chip needs beyond its HBM, where the compile got that far."""
    if not programs_.WORKER:
        return []
    runner = programs_.WORKER[0].model_runner
    if getattr(runner, "state", None) is None:
        return []
    from tpu_inference.utils import get_device_hbm_limit

    devices = list(runner.mesh.devices.flat)
    hbm = get_device_hbm_limit()
    budget = hbm * vllm_config.cache_config.gpu_memory_utilization
    weights = max(sum(abstract.bytes_on(d, holds) for holds in RESIDENT) for d in devices)
    length = vllm_config.model_config.max_model_len
    block = vllm_config.cache_config.block_size or 16
    per_token, window = kv_bytes_per_token(runner), _window(runner)
    one_request = _request_bytes(per_token, length, window)
    lines = []
    if found := COMPILER_HBM.search(message):  # the cache left a program too little room
        excess = (float(found["required"]) - float(found["available"])) * 2**30
    if excess > 0:
        excess *= 1.05
        cache = max(abstract.bytes_on(d, "kv_cache") for d in devices)
        if cache > excess:  # both flags size the cache over the whole slice, as the worker does
            utilization = (weights + cache - excess) / hbm
            lines.append(f"--gpu-memory-utilization {math.floor(utilization * 100) / 100:.2f} "
                         f"or --kv-cache-memory-bytes {int(cache - excess) * len(devices)}: "
                         "room for the program's temporaries")
    if weights + one_request > budget:
        room = budget - weights
        if room > sum(per_token) * block:
            fits = int(room // sum(per_token)) // block * block
            lines.append(f"--max-model-len {fits}: one request's KV cache in the "
                         f"{_gib(room)} the weights leave a chip")
        fp8 = _fp8_request_bytes(runner, length, window)
        if fp8 is not None and fp8 < one_request and weights + fp8 <= budget:
            lines.append(f"--kv-cache-dtype fp8: {_gib(fp8)} a request at {length:,} "
                         f"tokens, against {_gib(one_request)}")
        elif fp8 is not None and fp8 >= one_request:
            lines.append("(--kv-cache-dtype fp8 would not help here: with this many KV heads "
                         "a chip, tpu-inference packs fp8 into as many bytes as bfloat16)")
        quantized = weights - _quantizable_bytes(runner) / 2
        if quantized + one_request <= budget and quantized < weights:
            lines.append(f"--quant int8-weight-only: about {_gib(quantized)} of weights a chip, "
                         f"against {_gib(weights)}")
        if (more := _more_chips(vllm_config, weights, one_request, budget)) is not None:
            lines.append(more)
    return lines


def _more_chips(vllm_config, weights: float, one_request: float, budget: float) -> str | None:
    """The smallest slice of this generation on which the weights and one request's KV
    cache fit a chip, sharded further (KV heads shard until each chip holds one)."""
    from tpu_models.host import compile_target
    tp = vllm_config.parallel_config.tensor_parallel_size
    heads = vllm_config.model_config.get_total_num_kv_heads()
    generation = compile_target().split("-")[0]
    for name, t in TOPOLOGIES.items():
        if not name.startswith(generation + "-") or t.chips <= tp:
            continue
        kv = one_request * max(1, heads / t.chips) / max(1, heads / tp)
        if weights * tp / t.chips + kv <= budget:
            return (f"more chips: {name} with --tensor-parallel-size {t.chips}, about "
                    f"{_gib(weights * tp / t.chips)} of weights a chip")
    return None


def _fp8_request_bytes(runner, length: int, window: int) -> float | None:
    import torch
    if any(s.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
           for s in runner.get_kv_cache_spec().values()):
        return None  # already fp8
    return _request_bytes(kv_bytes_per_token(runner, torch.float8_e4m3fn), length, window)
