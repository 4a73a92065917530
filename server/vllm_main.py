"""vLLM's command line, with tpu-models' log filters (tpu_models.logs) installed first.

`tpu-models serve` runs `python -m tpu_models.server.vllm_main serve ...` rather than
`vllm serve ...`: the filters must be in place before vLLM's first import
probes the platform. Off-TPU the engine core is forked and inherits them; on
TPU it is spawned, and a spawned process re-imports its parent's main module,
so the top level below runs there too.
"""

from tpu_models import logs

logs.quiet()

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    main()
