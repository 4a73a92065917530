"""Log lines that are false, or mean nothing, when tpu-inference runs our models.

Each entry names the logger that emits it and how its message starts, and says
why it is dropped. A filter sits on that logger only, so anything else it says
(a real failure included) still reaches the log. Installed by
`server/vllm_main.py` before vLLM starts, in every vLLM process (forked ones
inherit them, spawned ones re-import it), and by the plugin
(tpu_models.adapt.apply).
Imports nothing heavy: it runs before vLLM is imported.
"""

import contextlib
import logging
import os
import sys
import threading
import warnings

# Off-TPU only: tpu-inference and vLLM probing for a TPU, a GPU toolchain or
# vLLM's CUDA extension, none of which this path uses.
OFF_TPU = {
    "vllm.tpu_inference.platforms.tpu_platform": (
        "Error getting device name",  # tpu_info finds no chip (8-18 times per start)
        "Pin memory is not supported on TPU"),
    "vllm.tpu_inference.tpu_info": ("Failed to detect number of TPUs", ),  # no /dev/vfio
    "vllm.usage.usage_lib": ("Failed to collect TPU information", ),  # the same probe
    "vllm.platforms.interface": ("Failed to import from vllm._C", ),  # CUDA kernels
    "vllm.config.vllm": ("Model Runner V2 requires Triton",  # a GPU runner option
                         "Inductor compilation was disabled",  # torch.compile: unused by JAX
                         # Any budget under 8,192 tokens with drafts; off-TPU the host's
                         # defaults choose 256 on purpose (a CPU step's cost grows with it).
                         "max_num_scheduled_tokens is set to"),
    "torch.utils.cpp_extension": ("No CUDA runtime is found", ),
}
# Everywhere.
ALWAYS = {
    # tpu-inference registers its own loader under vLLM's name, by design.
    "vllm.model_executor.model_loader": ("Load format `runai_streamer` is already registered", ),
    # vLLM may hand the runner an empty step (its engine core allows it); the
    # runner handles it and complains, at about every server's first request.
    "vllm.tpu_inference.runner.tpu_runner": ("Should not schedule a request that does nothing", ),
    # At every engine's shutdown: torch 2.10 has no empty_host_cache() for this
    # accelerator (a CUDA host cache; the version it names is not the cause).
    "vllm.distributed.parallel_state": ("torch.accelerator.empty_host_cache() only available", ),
}
# XLA:CPU and XLA:GPU cannot alias the buffers tpu-inference donates to a step.
DONATION_WARNING = "Some donated buffers were not usable"


class _DropMessages(logging.Filter):

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


# Weights the loader itself widens to their parameter's dtype (off_tpu.mark marks them).
WIDENED_BY_LOADER: set[str] = set()


class _SameDtype(logging.Filter):
    """vLLM's weight loader compares the checkpoint's torch dtype with a JAX
    parameter's dtype, so equal dtypes ("torch.float32" vs "float32") warn, once
    per tensor, and so does a weight the loader casts in its own pass
    (WIDENED_BY_LOADER); a real mismatch still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Attempted to load weight") or len(record.args) != 3:
            return True
        name, loaded, param = record.args
        return (str(loaded).removeprefix("torch.") != str(param)
                and name not in WIDENED_BY_LOADER)


class _ShutdownWatch(logging.Filter):
    """Notes vLLM's "[shutdown] API server: shutdown triggered" (a SIGINT or
    SIGTERM reached the API server); keeps every record."""
    triggered = False

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("[shutdown] API server: shutdown triggered"):
            _ShutdownWatch.triggered = True
        return True


class _EngineStoppedBySignal(logging.Filter):
    """A signal to the server's process group stops the engine core too, and
    the API server, already shutting down, reports its engine as dead with a
    traceback. After a triggered shutdown that report is dropped; any other
    failure of the output handler (or one before a shutdown) is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (_ShutdownWatch.triggered
                and str(record.msg).startswith("AsyncLLM output_handler failed")):
            return True
        error = record.exc_info[1] if record.exc_info else None
        return type(error).__name__ != "EngineDeadError"


# Printed by gloo from C++ for each group vLLM's distributed start-up makes (seven in a
# one-chip engine), and across local hosts by each JAX device's first collective,
# whatever the log level: nothing a user can act on.
GLOO_CONNECTED = b"[Gloo] Rank "


def _filter_stdout(prefix: bytes):
    """Drops the lines of this process's standard output that start with `prefix`, at
    the file descriptor (C++ writes there too); returns the function that stops it."""
    sys.stdout.flush()
    kept = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)

    def pump():
        with os.fdopen(read, "rb") as lines:
            for line in lines:
                if not line.startswith(prefix):
                    os.write(kept, line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()

    def stop():
        sys.stdout.flush()
        os.dup2(kept, 1)  # the pipe's last writer closed: the pump reads to its end
        thread.join()
        os.close(kept)
    return stop


@contextlib.contextmanager
def stdout_without(prefix: bytes = GLOO_CONNECTED):
    """This process's standard output without the lines that start with `prefix`,
    while the block runs."""
    stop = _filter_stdout(prefix)
    try:
        yield
    finally:
        stop()


def stdout_always_without(prefix: bytes = GLOO_CONNECTED) -> None:
    """This process's standard output without the lines that start with `prefix`,
    from now on."""
    _filter_stdout(prefix)


class _KvCacheOnThisHost(logging.Filter):
    """vLLM's stats line names the KV cache's device by the platform's type, "TPU KV
    cache usage", also where the cache is in this host's memory: it names the host's."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device

    def filter(self, record: logging.LogRecord) -> bool:
        if "KV cache usage" in str(record.msg) and isinstance(record.args, tuple):
            record.args = tuple(self.device if a == "TPU" else a for a in record.args)
        return True


class _UlimitAtItsHardLimit(logging.Filter):
    """vLLM asks for 65,535 open files and warns when the hard limit is lower. At the
    hard limit already, and with thousands of files, there is nothing to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Found ulimit of"):
            return True
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return not (soft == hard and soft >= 4096)


def quiet() -> None:
    """Installs the filters in this process (idempotent)."""
    from tpu_models.host import compile_target, host_platform  # standard library only
    # `tpu-models compile` runs on a host without a TPU too: the same probes fail there.
    off_tpu = host_platform() is not None or compile_target() is not None
    filters = [(name, _DropMessages(prefixes))
               for table in ([ALWAYS, OFF_TPU] if off_tpu else [ALWAYS])
               for name, prefixes in table.items()]
    if host_platform() is not None:
        filters.append(("vllm.v1.metrics.loggers", _KvCacheOnThisHost(host_platform().upper())))
    filters += [("vllm.utils.system_utils", _UlimitAtItsHardLimit()),
                ("vllm.model_executor.models.utils", _SameDtype()),
                ("vllm.entrypoints.launchers.launcher", _ShutdownWatch()),
                ("vllm.v1.engine.async_llm", _EngineStoppedBySignal())]
    for name, new in filters:
        logger = logging.getLogger(name)
        if not any(type(f) is type(new) for f in logger.filters):
            logger.addFilter(new)
    if off_tpu:
        warnings.filterwarnings("ignore", message=DONATION_WARNING)
