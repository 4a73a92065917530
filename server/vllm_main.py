"""vLLM's command line, with tpu-models' log filters (tpu_models.logs) installed first.

`tpu-models serve` runs `python -m tpu_models.server.vllm_main serve ...` rather than
`vllm serve ...`: the filters must be in place before vLLM's first import
probes the platform. Off-TPU the engine core is forked and inherits them; on
TPU it is spawned, and a spawned process re-imports its parent's main module,
so the top level below runs there too. Across hosts, this process starts the local
hosts --local-hosts asks for (Ray nodes; they stop when it exits), and exits 1
naming a host that was lost.
"""

from tpu_models import logs

logs.quiet()


def main() -> None:
    from tpu_models import multihost
    hosts = multihost.start_local_hosts()  # the nodes come up while vLLM is imported
    from vllm.entrypoints.cli.main import main
    if hosts:
        hosts.joined()
    main()
    if lost := multihost.lost_message():  # vLLM itself exits 0 once its engine is gone
        raise SystemExit(f"tpu-models serve: {lost}; the server stopped")


if __name__ == "__main__":
    main()
