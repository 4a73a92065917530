"""What would fit, when a configuration does not: each option checked by one arithmetic.

A chip fits a configuration when, at the --gpu-memory-utilization asked for, it
holds the weights, the buffers kept beside the cache (the penalties' counts,
LoRA slots), one request's KV cache at --max-model-len and the room the largest
step needs (tpu_models.memory) beside them: the sizing the engine itself does.
`Chip` holds those sizes as this compile found them; each option changes one of
them (more chips, quantized weights, an fp8 cache, a shorter context) and is
offered only if the same check passes. They are estimates: compile again with
the option to check it.
"""

import dataclasses
import math
import re

from tpu_models import memory
from tpu_models.topology.accounting import (
    DRAFT_WEIGHTS, HOST_INPUTS, KV_CACHE, WEIGHTS, WORKER, bytes_on)
from tpu_models.topology.slices import TOPOLOGIES

# libtpu's refusal of a program: "... HLO temporaries (19.75G) exceeds available HBM (15.75G)"
COMPILER_HBM = re.compile(r"\((?P<required>[\d.]+)G\) exceeds available HBM \((?P<available>[\d.]+)G\)")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class Chip:
    """One chip's sizes for a configuration, in bytes."""
    hbm: int
    utilization: float
    weights: float
    buffers: float  # kept beside the cache: the penalties' counts, LoRA slots
    step: memory.Step  # the largest step's working memory (the engine's bound)
    kv_per_token: tuple[float, float]  # (full-attention, sliding-window layers), summed
    window: int
    length: int  # --max-model-len
    block: int

    def one_request(self, length: int | None = None) -> float:
        full, sliding = self.kv_per_token
        length = self.length if length is None else length
        return full * length + sliding * min(length, self.window)

    def cache_room(self) -> float:
        """The KV cache the engine would allocate (tpu_models.memory.kv_cache_bytes)."""
        return memory.kv_cache_bytes(self.hbm, self.utilization,
                                     int(self.weights + self.buffers), self.step)

    def fits(self) -> bool:
        return self.cache_room() >= self.one_request()

    def longest_context(self) -> int:
        """The longest --max-model-len whose one request fits, in whole blocks."""
        room, (full, sliding) = self.cache_room(), self.kv_per_token
        if room <= 0:
            return 0
        # Within the window every layer's cache grows with the context; past it only
        # the full-attention layers' does.
        if room <= (full + sliding) * self.window or not self.window:
            tokens = room / (full + sliding)
        else:
            tokens = (room - sliding * self.window) / full if full else float(1 << 40)
        return int(min(tokens, 1 << 40) // self.block * self.block)


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


def _quantizable_bytes(runner) -> int:
    """Bytes per chip of the projection weights Qwix presets quantize (`*_proj`)."""
    from flax import nnx
    total = 0
    for path, x in nnx.to_flat_state(runner.state):
        value = getattr(x, "value", x)
        if any(str(p).endswith("_proj") for p in path) and hasattr(value, "sharding"):
            total += math.prod(value.sharding.shard_shape(value.shape)) * value.dtype.itemsize
    return total


def chip_of(vllm_config, runner) -> Chip:
    from tpu_inference.utils import get_device_hbm_limit
    devices = list(runner.mesh.devices.flat)
    weights = max(bytes_on(d, WEIGHTS) + bytes_on(d, DRAFT_WEIGHTS) for d in devices)
    return Chip(
        hbm=get_device_hbm_limit(), utilization=vllm_config.cache_config.gpu_memory_utilization,
        weights=weights, buffers=max(bytes_on(d, HOST_INPUTS) for d in devices),
        step=memory.step_of(vllm_config), kv_per_token=kv_bytes_per_token(runner),
        window=max((getattr(s, "sliding_window", 0) or 0
                    for s in runner.get_kv_cache_spec().values()), default=0),
        length=vllm_config.model_config.max_model_len,
        block=vllm_config.cache_config.block_size or 16)


def verdict(slice_name: str, chip: Chip) -> str:
    """One line naming HBM and the sizes, for a configuration the engine refused."""
    cap = chip.hbm * chip.utilization
    held = chip.weights + chip.buffers
    what = (f"weights {_gib(chip.weights)} and buffers {_gib(chip.buffers)} a chip"
            f" leave {_gib(max(0.0, chip.cache_room()))} for the KV cache")
    return (f"does not fit {slice_name}'s HBM: {_gib(chip.hbm)} a chip, {_gib(cap)} at "
            f"--gpu-memory-utilization {chip.utilization}; {what}, and one request at "
            f"--max-model-len {chip.length:,} needs {_gib(chip.one_request())}"
            + (" (the weights and buffers alone exceed it)" if held > cap else ""))


def compiled_runner():
    """The compile's model runner, once the model is built (else None)."""
    if not WORKER or getattr(WORKER[0].model_runner, "state", None) is None:
        return None
    return WORKER[0].model_runner


def what_would_fit(vllm_config, measured: memory.Step | None = None,
                   message: str = "") -> list[str]:
    """One line per option that passes the check. `measured`: the largest program's
    working memory by the compiler's accounting, where the compile got that far."""
    runner_ = compiled_runner()
    if runner_ is None:
        return []
    chip = chip_of(vllm_config, runner_)
    lines = []
    if found := COMPILER_HBM.search(message):  # a program the compiler itself refused
        excess = (float(found["required"]) - float(found["available"])) * 2**30
        if vllm_config.cache_config.kv_cache_memory_bytes:  # a cache of the size asked
            devices = list(runner_.mesh.devices.flat)
            kv = max(bytes_on(d, KV_CACHE) for d in devices)
            smaller = kv - excess * 1.05
            if smaller >= chip.one_request():
                lines.append(f"--kv-cache-memory-bytes {int(smaller) * len(devices)}: room "
                             "for the program the compiler refused")
            return lines
        needs = chip.hbm - chip.cache_room() - chip.weights - chip.buffers + excess
        measured = memory.Step(int(needs), "the program the compiler refused")
    if measured is not None and measured.bytes > chip.step.bytes:
        # The engine sizes its cache by its own bound, short of the compiler's count:
        # a lower utilization leaves the program the rest.
        lower = math.floor((1 - measured.bytes / chip.hbm) * 100) / 100
        shrunk = dataclasses.replace(chip, utilization=lower)
        if 0 < lower < chip.utilization and shrunk.fits():
            lines.append(f"--gpu-memory-utilization {lower:.2f}: the KV cache leaves "
                         f"{_gib(measured.bytes)} for {measured.what}")
        chip = dataclasses.replace(chip, step=measured)
    if not chip.fits():
        lines += _options(vllm_config, runner_, chip)
    return lines


def _options(vllm_config, runner, chip: Chip) -> list[str]:
    lines = []
    if (more := _more_chips(vllm_config, chip)) is not None:
        lines.append(more)
    quantizable = _quantizable_bytes(runner)
    for preset, saved in (("int8-weight-only", 1 / 2), ("int4-weight-only", 3 / 4)):
        smaller = dataclasses.replace(chip, weights=chip.weights - quantizable * saved)
        if quantizable and smaller.fits():
            lines.append(f"--quant {preset}: about {_gib(smaller.weights)} of weights a chip, "
                         f"against {_gib(chip.weights)}")
            break
    fp8 = _fp8(runner, chip)
    if fp8 is not None and fp8.one_request() < chip.one_request() and fp8.fits():
        lines.append(f"--kv-cache-dtype fp8: {_gib(fp8.one_request())} a request at "
                     f"{chip.length:,} tokens, against {_gib(chip.one_request())}")
    longest = chip.longest_context()
    if chip.block <= longest < chip.length:
        lines.append(f"--max-model-len {longest}: the longest context whose request fits "
                     f"beside the weights")
    return lines


def _more_chips(vllm_config, chip: Chip) -> str | None:
    """The smallest slice of this generation, at a tensor-parallel size that divides the
    heads, on which a chip fits its share (KV heads shard until each chip holds one)."""
    from tpu_models.host import compile_target
    tp = vllm_config.parallel_config.tensor_parallel_size
    heads = vllm_config.model_config.hf_text_config.num_attention_heads
    kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    generation = compile_target().split("-")[0]
    for name, t in sorted(TOPOLOGIES.items(), key=lambda kv: kv[1].chips):
        n = t.chips
        if not name.startswith(generation + "-") or n <= tp or heads % n or (
                kv_heads % n and n % kv_heads):
            continue
        kv_scale = max(1, kv_heads / n) / max(1, kv_heads / tp)
        wider = dataclasses.replace(chip, weights=chip.weights * tp / n, kv_per_token=tuple(
            b * kv_scale for b in chip.kv_per_token))
        if wider.fits():
            return (f"--topology {name} --tensor-parallel-size {n}: about "
                    f"{_gib(wider.weights)} of weights a chip")
    return None


def _fp8(runner, chip: Chip) -> Chip | None:
    import torch
    if any(s.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
           for s in runner.get_kv_cache_spec().values()):
        return None  # already fp8
    return dataclasses.replace(chip, kv_per_token=kv_bytes_per_token(runner, torch.float8_e4m3fn))
