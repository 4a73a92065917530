"""A `tpu-models serve` (hence `vllm serve`) process on loopback, for tests and benchmarks."""

import contextlib
import os
import re
import sys
import threading
import time
from pathlib import Path

from tpu_models.harness import preloaded
from tpu_models.server.loopback import ServeProcess

# vLLM's start-up line (v1/core/kv_cache_utils.py), e.g. "TPU KV cache size: 10,381
# tokens, Maximum concurrency for 512 tokens per request: 20.28x".
KV_CAPACITY = re.compile(r"KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency for "
                         r"[\d,]+ tokens per request: (?P<concurrency>[\d.]+)x")
STARTUP_TIMEOUT = 420  # seconds; a cold start on a 2-core host takes 1-2 minutes
# A server launches once the machine has this much memory available (or after
# MEMORY_WAIT seconds): the suite's two workers start servers side by side, each
# process about 1 GB, and a 24 GB host out of memory stalled every server on it.
HEADROOM, MEMORY_WAIT = 3 << 30, 300
# Off-TPU, token buckets past the smallest and largest compile after the server is
# ready (tpu_models/precompilation.py): its log says when they are all done.
BACKGROUND = "compile in the background"
SETTLED = "all token buckets compiled"
# The first line of a failure's own report in a server's log.
ROOT_CAUSE = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|Error: ")
# Plain vLLM's command line in this environment.
PLAIN_VLLM = [str(Path(sys.executable).parent / "vllm"), "serve"]


@contextlib.contextmanager
def launched(servers: dict[str, "Server"]):
    """Launches every server without waiting for any, and stops them all on exit.
    Start-ups side by side share the host's cores: one is mostly vLLM's
    single-threaded import (15-18 s on a 2-core host)."""
    try:
        for server in servers.values():
            server.launch()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def wait_for_memory(headroom: int = HEADROOM, timeout: float = MEMORY_WAIT) -> None:
    import psutil
    deadline = time.monotonic() + timeout
    while psutil.virtual_memory().available < headroom and time.monotonic() < deadline:
        time.sleep(1)


class Server(ServeProcess):
    """`with Server(model_dir, "--dtype", "float32", log=path) as s:` -> s.url, s.client().

    `command` replaces `tpu-models serve` (e.g. ["vllm", "serve"] for plain vLLM);
    `cwd` (default: this repository) is where it runs.
    """

    def __init__(self, model: str | None, *args: str, log: Path, env: dict | None = None,
                 command: list[str] | None = None, api_key: str | None = None,
                 cwd: Path | None = None, settle: bool = True, headroom: int = HEADROOM):
        """`settle`: `start` also waits for the token buckets that compile in the
        background (a benchmark measures a settled server); `startup_seconds` is
        the time to /health either way. `headroom`: the memory the machine must have
        available before it launches (a server larger than the default says so)."""
        super().__init__(log)
        self.headroom = headroom
        self.settle = settle
        self.api_key = api_key
        if api_key:
            args = (*args, "--api-key", api_key)
        self.argv = [*([str(model)] if model else []), "--port", str(self.port), *args]
        # `tpu-models serve` and this environment's plain `vllm serve` are forked
        # where they can be (harness/preloaded.py); any other command runs as given.
        self.fork_as = ("tpu-models" if command is None else
                        "vllm" if command == PLAIN_VLLM else None)
        base = command or [sys.executable, "-m", "tpu_models.server.cli", "serve"]
        self.command = [*base, *self.argv]
        # vLLM posts usage statistics to its server unless told not to: loopback only here.
        self.env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **(env or {})}
        self.cwd = cwd  # None: this process's

    def launch(self) -> "Server":
        """Starts the process without waiting for it to serve (`start` waits)."""
        wait_for_memory(self.headroom)
        if self.fork_as and preloaded.forks(self.env):
            self.started = time.monotonic()
            self.process = preloaded.launch(self.argv, self.env, self.log_path, self.cwd,
                                            plain_vllm=self.fork_as == "vllm")
        else:
            super().launch(self.command, self.env, self.cwd)
        return self

    def start(self) -> "Server":
        if self.process is None:
            self.launch()
        while time.monotonic() - self.started < STARTUP_TIMEOUT:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.tail()}")
            if self.healthy():
                self.startup_seconds = time.monotonic() - self.started
                if self.settle:
                    self.wait_settled()
                return self
            time.sleep(0.25)  # start-up times (bench startup) are read off this loop
        self.stop()
        raise TimeoutError(f"server not healthy after {STARTUP_TIMEOUT}s:\n{self.tail()}")

    def wait_settled(self, timeout: float = STARTUP_TIMEOUT) -> float:
        """Waits until no token bucket is left to compile in the background; returns
        the seconds from launch (0 for a server that compiled them all before ready)."""
        deadline = time.monotonic() + timeout
        while BACKGROUND in (log := self.output()) and SETTLED not in log:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"buckets still compiling after {timeout}s:\n{self.tail()}")
            time.sleep(0.25)
        return time.monotonic() - self.started if BACKGROUND in self.output() else 0.0

    def wait_exit(self, timeout: float = STARTUP_TIMEOUT) -> int:
        """For servers expected to fail: their exit code (after at most `timeout`)."""
        if self.process is None:
            self.launch()
        try:
            return self.process.wait(timeout)
        finally:
            self.stop()

    def kv_capacity(self, timeout: float = STARTUP_TIMEOUT) -> tuple[int, float]:
        """(tokens, maximum concurrency at --max-model-len) of the KV cache, as
        vLLM logs them once it is sized (before compilation: a launched server
        need not be started)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = KV_CAPACITY.search(self.output())
            if match:
                return int(match["tokens"].replace(",", "")), float(match["concurrency"])
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.tail()}")
            time.sleep(0.5)
        raise TimeoutError(f"no KV cache size logged after {timeout}s:\n{self.tail()}")

    def tail(self, lines: int = 60) -> str:
        """The log's last lines, after its first error block when that came earlier:
        an engine core's root cause is logged long before the API server's
        generic "Engine core initialization failed" traceback that ends the log."""
        log = self.output().splitlines()
        last = log[-lines:]
        first = next((i for i, line in enumerate(log) if ROOT_CAUSE.search(line)), None)
        if first is None or first >= len(log) - lines:
            return "\n".join(last)
        return "\n".join([*log[first:first + 40], "[...]", *last])

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs):
        from openai import OpenAI
        return OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", **kwargs)

    def async_client(self, **kwargs):
        from openai import AsyncOpenAI
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", **kwargs)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class TreeMemory:
    """Peak memory of a process and its children, sampled every 0.1 s, as their summed
    proportional set size: pages a forked engine core shares with the API server count
    once (their RSS would count them in both)."""

    def __init__(self, pid: int):
        import psutil
        self.root, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def now(self) -> int:
        import psutil
        total = 0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                total += p.memory_full_info().pss
            except psutil.NoSuchProcess:
                pass
        return total

    def _watch(self):
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.now())

    def stop(self) -> int:
        self._stop.set()
        return self.peak
