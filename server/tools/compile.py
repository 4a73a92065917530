"""`tpu-models compile`: every program a TPU would run, compiled for that TPU on any host.

MODEL and the options are `tpu-models serve`'s (vLLM's own parser reads them).
The engine then starts as `vllm serve` starts it (vLLM's EngineCore: the TPU
worker, its runner, the KV cache sized from HBM, precompilation), built for
the named slice's devices with nothing behind them (the seam's compile-only
patches): no weight is read or allocated, and each program precompilation
names is compiled by libtpu, the TPU's own compiler, and never run. The report
(from tpu_models.topology.accounting: what each chip holds, what compiled) says
what fits in a chip's HBM, how many tokens the KV cache holds, and each
program's cost as the compiler estimates it; --explain PROGRAM, where that
program's bytes go (compile_explain.py).

Exit status: 0 everything compiled and fits; 1 a program did not compile or
the configuration does not fit (named, with what would); 2 it could not run.
"""

import argparse
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

from tpu_models import host, logs, memory
from tpu_models.topology.slices import TOPOLOGIES, UnknownTopology, topology


class CannotRun(Exception):
    """Exit 2: the compile could not be attempted (not a verdict on the configuration)."""


class DoesNotFit(Exception):
    """Exit 1: start-up's own memory checks refuse the configuration."""

    def __init__(self, message: str, config):
        super().__init__(message)
        self.config = config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tpu-models compile",
        usage="tpu-models compile [MODEL] --topology NAME [--json PATH] [--explain PROGRAM] "
              "[serve options]",
        description="Compile every program `tpu-models serve MODEL [options]` would compile "
                    "at start-up on a TPU slice, with the TPU compiler, on this host: no TPU "
                    "and no weights needed (a directory with config.json and a tokenizer "
                    "will do). Reports HBM per chip, KV-cache capacity and each program's "
                    "cost as the compiler estimates it.",
        epilog="Topologies: " + ", ".join(TOPOLOGIES) + " (v5litepod-N: v5e-N). Other "
               "options are `tpu-models serve`'s and `vllm serve`'s.")
    p.add_argument("--topology", required=True, metavar="NAME",
                   help="the TPU slice, as Cloud TPU names it (v5e-1, v6e-8, v5p-8, ...)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report here")
    p.add_argument("--dump-hlo", type=Path, metavar="DIR",
                   help="write each compiled program's optimized HLO here")
    p.add_argument("--explain", metavar="PROGRAM",
                   help="where PROGRAM's bytes go (weights, KV cache, activations, "
                        "collectives, copies and pads), from its optimized HLO: a program's "
                        "name from the report, optionally with its variant, e.g. "
                        "'backbone tokens 16'")
    p.add_argument("--verbose", action="store_true",
                   help="vLLM's and tpu-inference's start-up log, and tracebacks")
    return p


def main(argv: list[str]) -> None:
    argv = list(argv)
    model = argv.pop(0) if argv and not argv[0].startswith("-") else None
    args, rest = parser().parse_known_args(argv)
    try:
        slice_ = topology(args.topology)
        model, vllm_args = serve_arguments(model, rest)
        prepare(slice_.name, args.verbose)
    except (UnknownTopology, ValueError, host.AttentionModeError) as e:
        sys.exit(_fail(2, f"cannot run: {e}"))
    from tpu_models.server.tools import compile_advice, compile_report
    compile_report.keep_hlo_text(bool(args.dump_hlo or args.explain))
    began = time.perf_counter()
    try:
        with compile_report.progress(slice_.name):  # gloo's lines: adapt/engine.py
            config, core = start_engine(model, vllm_args)
    except CannotRun as e:
        sys.exit(_fail(2, f"cannot run: {e}"))
    except DoesNotFit as e:  # the engine's own sizing refused it (its words: --verbose)
        runner = compile_advice.compiled_runner()
        if runner is None:
            sys.exit(_fail(1, f"does not fit {slice_.name}'s HBM: {e}"))
        _advise(compile_advice.what_would_fit(e.config))
        chip = compile_advice.chip_of(e.config, runner)
        sys.exit(_fail(1, compile_advice.verdict(slice_.name, chip)))
    report = compile_report.build(config, core, slice_)
    if args.dump_hlo:
        compile_report.dump_hlo(args.dump_hlo)
    report["compile_seconds"] = round(time.perf_counter() - began, 1)
    explained = _explained(report, core, args.explain) if args.explain else []
    compile_report.show(report)
    if explained:
        from tpu_models.server.tools import compile_explain
        compile_explain.show(report, explained)
    status, why = compile_report.verdict(report)
    if status == 1:
        chip = report["per_chip"]
        measured = memory.Step(chip["largest_program_transient_bytes"], chip["largest_program"])
        report["what_would_fit"] = compile_advice.what_would_fit(config, measured, why)
        _advise(report["what_would_fit"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"compile: {why}", flush=True)
    sys.exit(status)


def _explained(report: dict, core, spec: str) -> list[int]:
    """The programs --explain names, their `explain` in the report; exit 1 naming the
    programs there are when it names none."""
    from tpu_models.server.tools import compile_explain
    runner = core.model_executor.driver_worker.worker.model_runner
    try:
        return compile_explain.attach(report, runner.mesh.devices.flat[0], spec)
    except compile_explain.ProgramNotFound as e:
        sys.exit(_fail(1, str(e)))


def _advise(lines: list[str]) -> None:
    if not lines:
        print("Nothing within this generation's slices, quantization presets, KV cache "
              "types or contexts fits by this compile's arithmetic.", flush=True)
        return
    print("What would fit (estimates; compile again to check):", flush=True)
    for line in lines:
        print(f"  {line}", flush=True)


TRACEBACKS = "TPU_MODELS_COMPILE_TRACEBACKS"


def _fail(status: int, why: str) -> int:
    if os.environ.get(TRACEBACKS):
        import traceback
        traceback.print_exc()
    print(f"compile: {why}", file=sys.stderr, flush=True)
    return status


def serve_arguments(model: str | None, argv: list[str]) -> tuple[str, list[str]]:
    """MODEL and `vllm serve` arguments, from `tpu-models serve`'s options."""
    from tpu_models.quant import qwix_rules as quant_rules
    from tpu_models.server import serve
    args, vllm_args = serve.parser().parse_known_args(argv)
    if args.device != "auto":
        raise ValueError("--device: compile builds for the TPU topology, on this host's CPU")
    try:
        return serve.vllm_arguments(model, args, vllm_args)
    except quant_rules.RulesError as e:
        raise ValueError(str(e)) from None


def prepare(topology_name: str, verbose: bool = False) -> None:
    """This process's environment, before vLLM or JAX is imported."""
    host.setup_compile(topology_name)
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    else:
        os.environ[TRACEBACKS] = "1"
    os.environ.setdefault("MODEL_IMPL_TYPE", "flax_nnx")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # The engine runs in this process; TPU executables are not written into (or
    # read from) the host's compilation caches.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    os.environ["SKIP_JAX_PRECOMPILE"] = "0"  # precompilation is what there is to compile
    os.environ.setdefault("NUM_PRECOMPILE_WORKERS", str(min(os.cpu_count() or 1, 8)))
    host.attention_mode()  # AttentionModeError: a kernel other than the TPU's
    from tpu_models import logs
    logs.quiet()
    # Donation is decided per program at lowering; the warning is about buffers it can
    # reuse on a device, and nothing runs here.
    warnings.filterwarnings("ignore", message=logs.DONATION_WARNING)


def vllm_config(model: str, vllm_args: list[str]):
    """The VllmConfig `vllm serve MODEL ARGS` would run with, from vLLM's own parser."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.plugins import load_general_plugins
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    load_general_plugins()  # our architectures and adaptations, as in `vllm serve`
    top = FlexibleArgumentParser(prog="tpu-models compile")
    command = ServeSubcommand()
    command.subparser_init(top.add_subparsers())
    args = top.parse_args(["serve", model, *vllm_args])
    args.model = args.model_tag
    command.validate(args)
    return AsyncEngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER)


def start_engine(model: str, vllm_args: list[str]):
    """vLLM's engine core, started for the slice: (its VllmConfig, the engine core).
    Raises DoesNotCompile for a configuration that does not fit, CannotRun otherwise."""
    try:
        config = vllm_config(model, vllm_args)
    except SystemExit as e:  # argparse's own error line is already printed
        raise CannotRun(f"bad options ({e})") from None
    except Exception as e:
        raise CannotRun(f"{type(e).__name__}: {e}") from e
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor import Executor
    try:
        core = EngineCore(config, Executor.get_class(config), log_stats=False)
    except ValueError as e:  # the worker's and vLLM's own memory checks
        if MEMORY_CHECK.search(str(e)):
            raise DoesNotFit(str(e), config) from e
        raise CannotRun(f"{type(e).__name__}: {e}") from e
    except Exception as e:
        raise CannotRun(f"{type(e).__name__}: {e}") from e
    return config, core


# The refusals of tpu-inference's worker (HBM over --gpu-memory-utilization) and of
# vLLM's KV-cache sizing (not one request at --max-model-len).
MEMORY_CHECK = re.compile(r"total_hbm_used_gb|KV cache is needed|cache blocks", re.IGNORECASE)


if __name__ == "__main__":
    main(sys.argv[1:])
