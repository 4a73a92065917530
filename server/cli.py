"""The `tpu-models` command."""

import os
import sys

USAGE = """usage: tpu-models <command> [args]

commands:
  serve    serve a model (default: the embedded demo) with the real `vllm serve`
  doctor   check this host: platform, versions, adaptations, and both architectures
           served against transformers' greedy tokens (exit 0 ok, 1 mismatch, 2 cannot run)
  compile  compile every program serve would run on a TPU slice (--topology v6e-8), with the
           TPU compiler, on any host: HBM per chip, KV capacity, the compiler's cost estimates
  export   convert checkpoints to HF safetensors (maxtext, tunix, lora-merge, gemma3-text)
  inspect  print a checkpoint's format, layout and tensors (HF, MaxText, Tunix, PEFT)
  bench    benchmarks (tpu-models bench NAME --help; methods and figures: benchmarks/README.md):
             serve       throughput and latency of a server, vLLM's metrics
             compare     ours vs tpu-inference's built-in Qwen3 vs transformers generate
             step        decode-step time of a real-shaped model vs the host's memory bandwidth
             kv-cache    Gemma 3's hybrid KV cache vs disabled: capacity and speed
             startup     cold start and warm restart of tpu-models serve
             spec        speculative decoding on the demo: off, n-gram, EAGLE-3
             spec-calls  compiled programs launched per EAGLE-3 step
             lora        adapters chosen per request vs one merged adapter
             real-scale  real-shaped models served one request at a time
             ab          this tree against another git revision, both served
             compile     deployments compiled for their TPUs (estimates)
             penalties   the same load with and without penalties
             tunix       Tunix's vLLM rollouts on our Gemma 3 vs Tunix's own sampler
             quant       quality, weight bytes and speed of each quantization preset
             multihost   serving across local hosts (Ray) vs one process: start-up, tok/s

Each command takes --help.
"""


COMMANDS = "tpu_models.commands"  # entry-point group of commands that live outside server/


def _command(name: str):
    """The `main(argv)` registered for `name` in the COMMANDS entry points (pyproject.toml):
    `bench` lives in benchmarks/, which imports server/, never the other way."""
    from importlib.metadata import entry_points
    found = entry_points(group=COMMANDS, name=name)
    if not found:
        sys.exit(f"tpu-models {name}: not installed (no {name!r} entry point in group "
                 f"{COMMANDS!r}; reinstall the package: pip install -e .)")
    return next(iter(found)).load()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    command, rest = argv[0], argv[1:]
    if command in ("export", "inspect"):
        # Checkpoint conversion needs no accelerator: keep JAX (imported by orbax)
        # off libtpu, which would probe for TPUs and print warnings on other hosts.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from tpu_models.server.serve import emulated_storage
        emulated_storage(os.environ)  # one emulator variable set: every client goes there
    if command == "serve":
        from tpu_models.server import serve
        serve.main(rest)
    elif command == "compile":
        from tpu_models.server.tools import compile as compile_
        compile_.main(rest)
    elif command == "doctor":
        from tpu_models.server import doctor
        doctor.main(rest)
    elif command == "export":
        from tpu_models.server.tools import export
        export.main(rest)
    elif command == "inspect":
        import argparse
        inspect = argparse.ArgumentParser(
            prog="tpu-models inspect",
            description="Print a checkpoint's format (HF safetensors, MaxText or Tunix "
                        "Orbax, PEFT adapter), its layout (scanned layers or not, LoRA only) "
                        "and every tensor's name, shape and dtype; nothing is converted. "
                        "Export it with `tpu-models export`.")
        inspect.add_argument("checkpoint", metavar="CKPT_DIR|gs://BUCKET/PREFIX")
        rest = [inspect.parse_args(rest).checkpoint]
        from tpu_models.loaders.hf import CheckpointError
        from tpu_models.loaders.inspect import print_description
        from tpu_models import registry
        families = {a.export_name: a.tunix for a in registry.architectures() if a.tunix}
        try:
            print_description(rest[0], families)
        except CheckpointError as e:
            sys.exit(f"tpu-models inspect: {e}")
    elif command == "bench":
        from tpu_models import host
        # `bench step` and `bench quant` run tpu-inference in this process: on this
        # host's CPU unless it has a TPU, and never asking the cloud metadata server.
        host.setup_host()
        _command("bench")(rest)
    else:
        sys.exit(f"tpu-models: unknown command {command!r}\n{USAGE}")


if __name__ == "__main__":
    main()
