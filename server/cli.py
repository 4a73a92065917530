"""The `tpu-models` command."""

import sys

USAGE = """usage: tpu-models <command> [args]

commands:
  serve    serve a model (default: the embedded demo) with the real `vllm serve`
  export   convert checkpoints to HF safetensors (lora-merge, gemma3-text)
  bench    serving benchmarks (serve)
"""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from server import serve
        serve.main(rest)
    elif command == "export":
        from server import export
        export.main(rest)
    elif command == "bench":
        from server import bench
        bench.main(rest)
    else:
        sys.exit(f"tpu-models: unknown command {command!r}\n{USAGE}")


if __name__ == "__main__":
    main()
