"""What `tpu-models compile` found: memory per chip, KV capacity, each program's cost.

Costs are libtpu's own estimates for the compiled programs (cost_analysis,
memory_analysis), never measurements. `estimated_seconds` is the bytes it
counts as accessed over the chip's HBM bandwidth (its own `optimal_seconds`,
where that is sane). It misses the paged KV reads inside the attention kernel
(a Pallas call), so the decode roofline beside it adds them: weights and KV
bytes read per step over the chip's bandwidth; each program's `kv_read_bytes` are
its kernels' share of them (KvReads).
"""

import contextlib
import dataclasses
import re
import sys

from tpu_models import memory
from tpu_models.sampler import counts
from tpu_models.topology.accounting import (
    DRAFT_WEIGHTS, HOST_INPUTS, KEEP_HLO_TEXT, KV_CACHE, PROGRAMS, WEIGHTS, Program, bytes_by_dtype,
    bytes_on, settled, shard_shapes)
from tpu_models.topology.costs import hlo_shape

# What a compiler refusal ran out of, by its message.
_LIMITS = (("HBM", re.compile(r"\bHBM\b")), ("VMEM", re.compile(r"vmem", re.IGNORECASE)),
           ("SMEM", re.compile(r"smem", re.IGNORECASE)), ("Mosaic", re.compile(r"Mosaic")))
# Collectives by opcode (an asynchronous one as its -start).
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@contextlib.contextmanager
def progress(topology: str, every: float = 30.0):
    """The programs compiled so far, the one under way and the time, on stderr while the
    engine starts: a live bar on a terminal, else a line every `every` seconds."""
    import threading
    import time

    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console, began, stop = Console(stderr=True), time.monotonic(), threading.Event()

    def status() -> str:
        programs = list(PROGRAMS)
        done = sum(p.costs is not None or p.error is not None for p in programs)
        latest = re.sub(r"^worker\d+ ", "", programs[-1].name) if programs else "building the model"
        return f"compiling for {topology}: {done} of {len(programs)} programs, now {latest}"

    with contextlib.ExitStack() as stack:
        if console.is_terminal:
            bar = stack.enter_context(Progress(
                SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                console=console, transient=True))
            task = bar.add_task(status())
            period, show = 0.5, lambda: bar.update(task, description=status())
        else:
            period, show = every, lambda: print(
                f"{status()} ({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)

        def poll():
            while not stop.wait(period):
                show()

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def _label_of(program: Program) -> str:
    name = re.sub(r"^worker\d+ ", "", program.name)
    return f"{name} {program.signature}" if program.signature else name


@dataclasses.dataclass(frozen=True)
class KvReads:
    """The KV cache the attention kernel reads in a step, on one chip: a request at
    --max-model-len reads its ceil(max_model_len / page size) pages a layer (the cache's
    bytes over vLLM's concurrency, which counts those pages), the cache full all of
    it. A program's share: the KV-cache buffers its kernel calls take, of the chip's."""
    one_request: float
    full_cache: int
    shapes: frozenset[str]  # a KV-cache buffer's shape on a chip, as HLO writes it
    buffers: int

    @classmethod
    def of(cls, chip, kv: int, concurrency: float) -> "KvReads":
        found = shard_shapes(chip, KV_CACHE)
        return cls(kv / concurrency if concurrency else 0.0, kv,
                   frozenset(hlo_shape(*key) for key in found), sum(found.values()))

    def share(self, program: Program) -> float:
        """The part of the chip's KV-cache buffers `program`'s kernel calls read."""
        taken = sum(shape in self.shapes for shape in program.costs.kernel_inputs)
        return min(taken / self.buffers, 1.0) if self.buffers else 0.0


def program_entry(program: Program, bandwidth: float, kv_reads: KvReads | None = None) -> dict:
    entry = {"name": re.sub(r"^worker\d+ ", "", program.name), "tokens": program.signature.get("num_tokens"),
             "requests": program.signature.get("num_reqs"),
             "signature": {k: v for k, v in program.signature.items()
                           if k not in ("num_tokens", "num_reqs")}}
    if program.warm_up:  # compiled by this warm-up call, as on a TPU
        entry["warm_up"] = re.sub(r"^worker\d+ ", "", program.warm_up)
    if program.same_as is not None:  # its module is an earlier variant's: compiled once
        entry["same_program_as"] = _label_of(program.same_as)
    entry["lowering_seconds"] = round(program.lowering_seconds, 2)
    if program.costs is None:
        kind = next((name for name, pattern in _LIMITS if pattern.search(program.error or "")),
                    "other")
        return {**entry, "error": program.error, "error_kind": kind}
    costs = program.costs
    ops = costs.hlo_ops
    counts = {name: ops.get(name, 0) + ops.get(f"{name}-start", 0) for name in COLLECTIVES}
    return {**entry, "flops": costs.flops, "bytes_accessed": costs.bytes_accessed,
            # libtpu's optimal_seconds is these bytes over the chip's bandwidth where it is
            # sane; for 8B-sized steps it read -36 s. The arithmetic is done here.
            "estimated_seconds": costs.bytes_accessed / bandwidth,
            "compiler_optimal_seconds": costs.optimal_seconds,
            "all_reduces": counts["all-reduce"], "all_gathers": counts["all-gather"],
            "other_collectives": sum(counts.values()) - counts["all-reduce"]
            - counts["all-gather"],
            "hlo_ops": ops,
            "argument_bytes": costs.argument_bytes,
            "output_bytes": costs.output_bytes,
            "temp_bytes": costs.temp_bytes,
            # What it needs beside the chip's buffers: temporaries, outputs that are no
            # donated input's (a KV cache updated in place), inputs made for the step.
            "transient_bytes": costs.temp_bytes + costs.output_bytes - costs.alias_bytes
            + program.transient_input_bytes,
            "compile_seconds": round(program.seconds, 2),
            # Not in bytes_accessed: the Pallas kernel's reads at one request of
            # --max-model-len (0: no attention kernel call).
            "kv_read_bytes": kv_reads.one_request * kv_reads.share(program) if kv_reads else 0.0}


def keep_hlo_text(keep: bool) -> None:
    """Whether each program's optimized HLO text is kept for dump_hlo (memory: only then)."""
    KEEP_HLO_TEXT[0] = keep


def dump_hlo(directory) -> None:
    """Each compiled program's optimized HLO, as `NNN-name.txt` (kept: --dump-hlo)."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, program in enumerate(PROGRAMS):
        if program.costs is not None and program.costs.hlo_text is not None:
            name = re.sub(r"[^\w.-]+", "_", f"{program.name} {program.signature}")[:120]
            (directory / f"{i:03d}-{name}.txt").write_text(program.costs.hlo_text)


def _chip_bandwidth(mesh) -> float:
    import jax
    from jax.experimental.pallas import tpu as pltpu
    with jax.set_mesh(mesh):
        info = pltpu.get_tpu_info()  # per TensorCore, of the mesh's devices
    return float(info.mem_bw_bytes_per_second * info.num_cores)


def build(vllm_config, core, slice_) -> dict:
    """The report, as a JSON-able dict (the fields `tpu-models compile --json` writes)."""
    from tpu_inference.utils import get_device_hbm_limit

    runner = core.model_executor.driver_worker.worker.model_runner
    devices = list(runner.mesh.devices.flat)
    chip = devices[0]
    cache = vllm_config.cache_config
    bandwidth = _chip_bandwidth(runner.mesh)
    kv = max(bytes_on(d, KV_CACHE) for d in devices)
    concurrency = float(cache.kv_cache_max_concurrency or 0)
    kv_reads = KvReads.of(chip, kv, concurrency)
    programs = [program_entry(p, bandwidth, kv_reads) for p in settled()]
    compiled = [p for p in programs if "error" not in p]
    # The programs a server runs once its KV cache is allocated (not the load's).
    serving = [p for p in compiled if not p["name"].startswith("load > ")]
    largest = max(serving, key=lambda p: p["transient_bytes"], default=None)
    hbm = get_device_hbm_limit()
    weights = max(bytes_on(d, WEIGHTS) + bytes_on(d, DRAFT_WEIGHTS) for d in devices)
    # Buffers kept beside the cache: the penalties' counts, LoRA slots, the RNG key.
    other = max(bytes_on(d, HOST_INPUTS) for d in devices)
    transient = largest["transient_bytes"] if largest else 0
    decode = min((p for p in compiled if p["name"] == "backbone"),
                 key=lambda p: p["tokens"], default=None)
    return {
        "topology": slice_.name, "device_kind": chip.device_kind,
        "chips": len(devices), "hosts": len({d.process_index for d in devices}),
        "slice_chips": slice_.chips, "slice_hosts": slice_.hosts,
        "model": vllm_config.model_config.model,
        "architecture": (vllm_config.model_config.architectures or ["?"])[0],
        "dtype": str(vllm_config.model_config.dtype).replace("torch.", ""),
        "kv_cache_dtype": cache.cache_dtype,
        "kv_cache_element_type": _kv_element_type(runner),
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "max_model_len": vllm_config.model_config.max_model_len,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "fits": not any("error" in p for p in programs) and weights + other + kv + transient <= hbm,
        "per_chip": _per_chip(chip, hbm, weights, kv, other, serving, largest,
                              memory.step_of(vllm_config)),
        "kv_cache_tokens": int(cache.kv_cache_size_tokens or 0),
        "kv_cache_blocks": int(cache.num_gpu_blocks or 0), "block_size": cache.block_size,
        "max_concurrent_requests": round(concurrency, 2),
        "decode_roofline": _decode_roofline(bandwidth, weights, kv_reads, decode),
        "programs": programs,
    }


def _per_chip(chip, hbm: int, weights: int, kv: int, other: int, serving: list[dict],
              largest: dict | None, step) -> dict:
    """A chip's memory: what its buffers hold, the largest program's needs, what is left."""
    counts = penalty_counts_bytes()
    transient = largest["transient_bytes"] if largest else 0
    return {"hbm_bytes": hbm, "weights_bytes": weights, "kv_cache_bytes": kv,
            "other_bytes": other,
            "buffers": {"penalty counts": counts, "LoRA slots and other inputs": other - counts},
            "largest_program_temp_bytes": max((p["temp_bytes"] for p in serving), default=0),
            "largest_program_transient_bytes": transient,
            "weights_by_dtype": _weights_by_dtype(chip),
            "largest_program": _label(largest) if largest else None,
            # The bound the KV cache was sized to leave room for (tpu_models.memory).
            "largest_step_estimate_bytes": step.bytes, "largest_step_estimate": step.what,
            "free_bytes": hbm - weights - other - kv - transient}


def _decode_roofline(bandwidth: float, weights: int, kv: KvReads, decode: dict | None) -> dict:
    """A decode step's time if it only read the weights (and the KV cache) from HBM."""
    return {"bandwidth_bytes_per_second": bandwidth,
            "weights_only_seconds": weights / bandwidth,
            "one_request_at_max_model_len_seconds": (weights + kv.one_request) / bandwidth,
            "full_cache_seconds": (weights + kv.full_cache) / bandwidth,
            "kv_read_bytes_one_request": kv.one_request,
            "program": _label(decode) if decode else None,
            "compiler_estimate_seconds": decode["estimated_seconds"] if decode else None}


def penalty_counts_bytes() -> int:
    """A chip's bytes of the penalties' counts (allocated at start-up, replicated)."""
    return counts.allocated_bytes_a_chip()


def _kv_element_type(runner) -> str | None:
    """What the cache stores (--kv-cache-dtype fp8: e4m3, tpu-inference's for flax models)."""
    dtypes = {str(spec.dtype).replace("torch.", "") for spec in runner.get_kv_cache_spec().values()}
    return ", ".join(sorted(dtypes)) or None


def _weights_by_dtype(device) -> dict[str, int]:
    """A chip's weight bytes by dtype (quantized weights show as int8, fp8, int4)."""
    out: dict[str, int] = {}
    for holds in (WEIGHTS, DRAFT_WEIGHTS):
        for dtype, n in bytes_by_dtype(device, holds).items():
            out[dtype] = out.get(dtype, 0) + n
    return out


def _label(program: dict) -> str:
    shape = ", ".join(f"{k} {v}" for k, v in (("tokens", program["tokens"]),
                                               ("requests", program["requests"])) if v)
    return f"{program['name']} ({shape})" if shape else program["name"]


def verdict(report: dict) -> tuple[int, str]:
    failed = [p for p in report["programs"] if "error" in p]
    if failed:
        first = failed[0]
        return 1, (f"{len(failed)} of {len(report['programs'])} programs did not compile for "
                   f"{report['topology']}; first: {_label(first)} ({first['error_kind']}): "
                   f"{first['error']}")
    chip = report["per_chip"]
    if not report["fits"]:
        return 1, (f"does not fit {report['topology']}'s HBM: a chip needs {_gib(needed(report))}"
                   f" (weights {_gib(chip['weights_bytes'])}, KV cache "
                   f"{_gib(chip['kv_cache_bytes'])}, buffers {_gib(chip['other_bytes'])}, "
                   f"{chip['largest_program']} {_gib(chip['largest_program_transient_bytes'])})"
                   f" and has {_gib(chip['hbm_bytes'])}")
    return 0, (f"{len(report['programs'])} programs compiled for {report['topology']}; fits: "
               f"{_gib(chip['weights_bytes'])} weights + {_gib(chip['kv_cache_bytes'])} KV cache "
               f"per chip, {report['kv_cache_tokens']:,} tokens, "
               f"{report['max_concurrent_requests']:.1f} requests at {report['max_model_len']:,}")


def needed(report: dict) -> int:
    """HBM a chip needs: what it holds, and the largest program's temporaries."""
    chip = report["per_chip"]
    return (chip["weights_bytes"] + chip["other_bytes"] + chip["kv_cache_bytes"]
            + chip["largest_program_transient_bytes"])


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def show(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    chip = report["per_chip"]
    console.print(f"[bold]{report['architecture']}[/bold] {report['model']} on "
                  f"[bold]{report['topology']}[/bold] ({report['chips']} x {report['device_kind']}"
                  f", {report['hosts']} host(s)), TP {report['tensor_parallel_size']}, "
                  f"{report['dtype']}, KV cache {report['kv_cache_dtype']}")
    console.print(accounting(report))
    console.print(f"KV cache: {report['kv_cache_tokens']:,} tokens ({report['kv_cache_blocks']:,} "
                  f"blocks of {report['block_size']}), {report['max_concurrent_requests']:.2f} "
                  f"requests at --max-model-len {report['max_model_len']:,}")
    table = Table(title="Programs (times: the compiler's estimates, not measurements)",
                  title_justify="left")
    for column in ("program", "variants", "tokens", "requests", "GFLOP", "MB accessed",
                   "est. ms", "all-reduce", "all-gather", "temp MB"):
        table.add_column(column, justify="left" if column == "program" else "right")
    for name, group in _grouped(report["programs"]):
        done = [p for p in group if "error" not in p]
        table.add_row(
            name, str(len(group)), _span(p["tokens"] for p in group),
            _span(p["requests"] for p in group),
            _span(round(p["flops"] / 1e9, 3) for p in done),
            _span(round(p["bytes_accessed"] / 1e6, 1) for p in done),
            _span(round(p["estimated_seconds"] * 1e3, 3) for p in done),
            _span(p["all_reduces"] for p in done), _span(p["all_gathers"] for p in done),
            _span(round(p["temp_bytes"] / 1e6, 1) for p in done))
        for p in group:
            if "error" in p:
                table.add_row(f"  [red]not compiled[/red] {_label(p)}: {p['error'][:200]}")
    console.print(table)
    roof = report["decode_roofline"]
    if roof["program"]:
        console.print(
            f"Decode step, {roof['program']}: compiler estimate "
            f"{roof['compiler_estimate_seconds'] * 1e3:.3f} ms; HBM roofline at "
            f"{roof['bandwidth_bytes_per_second'] / 1e9:.0f} GB/s a chip: weights only "
            f"{roof['weights_only_seconds'] * 1e3:.3f} ms, one request at "
            f"{report['max_model_len']:,} tokens {roof['one_request_at_max_model_len_seconds'] * 1e3:.3f}"
            f" ms, the cache full {roof['full_cache_seconds'] * 1e3:.3f} ms (estimates, not "
            "measurements)")


def accounting(report: dict):
    """One chip's HBM, line by line, adding up to what is free."""
    from rich.table import Table
    chip = report["per_chip"]
    table = Table(title=f"HBM of one chip ({report['device_kind']}), KV cache sized at "
                        f"--gpu-memory-utilization {report['gpu_memory_utilization']}",
                  title_justify="left")
    table.add_column("")
    table.add_column("GiB", justify="right")
    for dtype, n in sorted(chip["weights_by_dtype"].items(), key=lambda kv: -kv[1]):
        table.add_row(f"weights, {dtype}", f"{n / 2**30:.3f}")
    table.add_row(f"KV cache ({report['kv_cache_tokens']:,} tokens)",
                  f"{chip['kv_cache_bytes'] / 2**30:.3f}")
    for name, n in chip["buffers"].items():
        table.add_row(name, f"{n / 2**30:.3f}")
    table.add_row(f"largest program's temporaries, outputs and step inputs: "
                  f"{chip['largest_program']}",
                  f"{chip['largest_program_transient_bytes'] / 2**30:.3f}")
    table.add_row("free", f"{chip['free_bytes'] / 2**30:.3f}",
                  style=None if chip["free_bytes"] >= 0 else "red")
    table.add_row("HBM", f"{chip['hbm_bytes'] / 2**30:.3f}", style="bold")
    return table


def _grouped(programs: list[dict]):
    groups: dict[str, list[dict]] = {}
    for p in programs:
        groups.setdefault(p["name"], []).append(p)
    return groups.items()


def _span(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return ""
    low, high = min(values), max(values)
    return f"{low}" if low == high else f"{low}-{high}"
