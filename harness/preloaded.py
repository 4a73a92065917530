"""`tpu-models serve` (and plain `vllm serve`) forked from an interpreter that has
imported vLLM already.

A server spends 12-15 s of a core importing vLLM's stack before it logs a line;
the suite starts about sixty. The tests (not the benchmarks, whose start-up
figures must be a fresh process's) fork them from a server process that did
those imports once (multiprocessing's forkserver, as vLLM itself forks its
engine core after the same imports). What runs is unchanged: `tpu-models
serve`'s checks and vLLM's own command line, in a process of its own session,
its output to the log. A server whose environment sets a JAX option that JAX
reads on import is started afresh instead.
"""

import atexit
import multiprocessing
import os
import subprocess
import sys

# The server's own `python -m tpu_models.server.vllm_main` imports, once.
PRELOAD = ["tpu_models.server.vllm_main", "tpu_models.server.serve",
           "vllm.entrypoints.cli.main", "vllm.entrypoints.openai.api_server"]
ENABLED = False  # the tests set it (tests/conftest.py); benchmarks leave it
_context = None
_preloaded_env: dict = {}  # the forkserver's environment, once it is started


def forks(env: dict) -> bool:
    """Whether a process of environment `env` is forked: where enabled, unless `env`
    differs from the preloaded one in a variable read at import (JAX's options,
    Python's own)."""
    preloaded = _preloaded_env if _context is not None else os.environ
    keys = {k for k in set(env) | set(preloaded) if k.startswith(("JAX_", "PYTHON"))}
    return ENABLED and all(env.get(k) == preloaded.get(k) for k in keys)


def _fork(target, args: tuple, name: str) -> "Forked":
    global _context, _preloaded_env
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        _preloaded_env = dict(os.environ)  # what the forkserver starts with, below
    process = _context.Process(target=target, args=args, name=name)
    process.start()
    return Forked(process)


def launch(argv: list[str], env: dict, log: str, cwd=None, plain_vllm=False) -> "Forked":
    """`tpu-models serve ARGV` (argv after `serve`) forked, writing to `log`; with
    `plain_vllm`, `vllm serve ARGV`."""
    name = "vllm serve" if plain_vllm else "tpu-models serve"
    return _fork(_serve, (argv, env, str(log), cwd, plain_vllm), name)


def python_module(module: str, args: list[str], env: dict, log, cwd=None):
    """`python -m MODULE ARGS` (a test's script that runs an engine in a process
    of its own), writing to `log`: forked where it can be, else started afresh.
    A subprocess.Popen or its surface (`Forked`)."""
    return _python(["-m", module], args, env, log, cwd)


def python_code(code: str, args: list[str], env: dict, log, cwd=None):
    """`python -c CODE ARGS`, as python_module."""
    return _python(["-c", code], args, env, log, cwd)


def _python(how: list[str], args, env, log, cwd):
    if not forks(env):
        with open(log, "w") as out:
            return subprocess.Popen([sys.executable, *how, *args], env=env, cwd=cwd,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return _fork(_run, (how, args, env, str(log), cwd), f"python {how[0]}")


def _run(how, args, env, log, cwd) -> None:
    import runpy
    _become(env, log, cwd)
    if cwd is not None:
        sys.path.insert(0, str(cwd))  # as `python` run there
    kind, what = how
    sys.argv = [what if kind == "-m" else "-c", *args]
    try:
        if kind == "-m":
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
    finally:
        atexit._run_exitfuncs()


def _become(env, log, cwd) -> None:
    """This process as one started with `env` in `cwd`, its output to `log`."""
    os.setsid()  # a group of its own: a stop reaches the engine core it forks
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):  # vLLM's log handlers hold these objects
        stream.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)


def _serve(argv, env, log, cwd, plain_vllm) -> None:
    """vLLM's own command line, after `tpu-models serve`'s checks and defaults; plain,
    as the `vllm` script runs it: it loads our plugin through its entry point, as a
    fresh process does (the preloaded imports load no plugin, register nothing)."""
    _become(env, log, cwd)
    if plain_vllm:
        sys.argv = ["vllm", "serve", *argv]
        from vllm.entrypoints.cli.main import main
    else:
        from tpu_models.server import serve
        command, _ = serve.prepare(argv)
        sys.argv = ["vllm", *command[3:]]  # [python, -m, vllm_main, serve, ...]
        from tpu_models.server.vllm_main import main
    try:
        main()
    finally:
        atexit._run_exitfuncs()  # a process's exit runs them; multiprocessing's does not


class Forked:
    """The subprocess.Popen surface the harness uses, over a forked server."""

    def __init__(self, process):
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self._process.exitcode
