"""A `tpu-models serve` process on loopback, in a process group of its own.

What `tpu-models doctor` (server/doctor.py) and the tests' and benchmarks'
harness (harness/serve_process.py) share: a free port, the launch, the health
check and the stop. Standard library only.
"""

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """A server on 127.0.0.1:`port` (chosen here, for the command the caller builds),
    its output in `log_path`."""

    def __init__(self, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.process = None
        self._log = None

    def launch(self, command: list[str], env: dict, cwd: Path | None = None) -> None:
        """Starts it without waiting: its own session, so a stop reaches the engine
        core and every helper it forked."""
        self._log = open(self.log_path, "w")
        self.started = time.monotonic()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, cwd=cwd, start_new_session=True)

    def healthy(self, timeout: float = 2) -> bool:
        """Whether /health answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, grace: float = 30) -> None:
        """Sends `sig` to the process group (as a service manager, or Ctrl-C in a
        terminal, does) and waits; kills the group after `grace` seconds."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
