"""A healthy start and stop of `tpu-models serve` logs no error and none of the
lines tpu_models.logs silences; those filters drop only what they name."""

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys

import pytest

from tpu_models.harness.serve_process import Server, launched
from tpu_models import logs
from tests.conftest import DEMO_ENGINE

SILENCED = [prefix for table in (logs.OFF_TPU, logs.ALWAYS) for prefixes in table.values()
            for prefix in prefixes]


@contextlib.contextmanager
def captured(logger_name: str):
    """The messages `logger_name` passes on (after its filters) while inside."""
    logger, seen = logging.getLogger(logger_name), []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def records_through(logger_name: str, *messages) -> list[str]:
    with captured(logger_name) as seen:
        for message, *args in messages:
            logging.getLogger(logger_name).warning(message, *args)
    return seen


def test_filters_drop_only_the_named_messages(monkeypatch):
    logs.quiet()  # JAX_PLATFORMS=cpu here (conftest): the off-TPU table too
    assert records_through(
        "vllm.tpu_inference.platforms.tpu_platform",
        ("Error getting device name: %s", "'NoneType' object has no attribute 'name'"),
        ("Something else went wrong",)) == ["Something else went wrong"]
    # equal dtypes spelled by torch and JAX are dropped, and so is a weight the loader
    # casts itself (adapt.loading); a real mismatch is kept
    template = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    monkeypatch.setattr(logs, "WIDENED_BY_LOADER", {"cast"})
    assert records_through(
        "vllm.model_executor.models.utils",
        (template, "w", "torch.float32", "float32"),
        (template, "cast", "torch.bfloat16", "float32"),
        (template, "w", "torch.bfloat16", "float32")) == [
            "Attempted to load weight w with dtype torch.bfloat16 into parameter with dtype float32"]


def test_a_healthy_logs_lines_a_user_cannot_act_on(monkeypatch):
    import resource
    logs.quiet()
    # The KV cache's device is this host's, not the platform's type.
    assert records_through("vllm.v1.metrics.loggers", (
        "Engine 000: Avg prompt throughput: %.1f tokens/s, %s KV cache usage: %.1f%%", 1.0,
        "TPU", 2.0)) == ["Engine 000: Avg prompt throughput: 1.0 tokens/s, CPU KV cache usage: 2.0%"]
    # vLLM's ulimit warning, at the hard limit already (this host's 20,000): dropped;
    # below a hard limit that could be raised, kept.
    warning = ("Found ulimit of %s and failed to automatically increase with error %s.", 20000, "e")
    monkeypatch.setattr(resource, "getrlimit", lambda _: (20000, 20000))
    assert records_through("vllm.utils.system_utils", warning) == []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 20000))
    assert len(records_through("vllm.utils.system_utils", warning)) == 1
    # torch's gloo groups print from C++ to the file descriptor: filtered there.
    script = ("import os\nfrom tpu_models import logs\n"
              "with logs.stdout_without(logs.GLOO_CONNECTED):\n"
              "    os.write(1, b'[Gloo] Rank 0 is connected to 0 peer ranks.\\nkept\\n')\n"
              "print('after')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout == "kept\nafter\n", done.stdout + done.stderr


def test_a_dead_engine_is_reported_unless_a_signal_stopped_the_server(monkeypatch):
    from vllm.v1.engine.exceptions import EngineDeadError

    logs.quiet()
    monkeypatch.setattr(logs._ShutdownWatch, "triggered", False)

    def report() -> list[str]:
        with captured("vllm.v1.engine.async_llm") as seen:
            try:
                raise EngineDeadError()
            except EngineDeadError:
                logging.getLogger("vllm.v1.engine.async_llm").exception(
                    "AsyncLLM output_handler failed.")
        return seen

    assert report() == ["AsyncLLM output_handler failed."]  # a real failure
    records_through("vllm.entrypoints.launchers.launcher",
                    ("[shutdown] API server: shutdown triggered",))
    assert report() == []  # the engine stopped by the same signal


def bad_lines(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if re.search(r"\bERROR\b|Traceback|\[Gloo\]", line)
            or any(p in line for p in SILENCED)]


@pytest.mark.e2e
def test_demo_server_log_tells_the_truth(tmp_path):
    """Stopped with Ctrl-C and with SIGTERM (two servers, started at once)."""
    stops = {"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM}
    servers = {name: Server(None, *DEMO_ENGINE, log=tmp_path / f"{name}.log")
               for name in stops}
    with launched(servers):
        for name, server in servers.items():
            server.start()
            server.client().completions.create(model="qwen3-structural-demo",
                                               prompt="Lena works", max_tokens=8)
            server.stop(stops[name])
    for name, server in servers.items():
        log = server.output()
        assert bad_lines(log) == [], name
        ready = re.search(r"tpu-models: ready: qwen3-structural-demo \(float32, cpu, attention portable\), KV cache "
                          r"([\d,]+) tokens, ([\d.]+) requests at --max-model-len 256, "
                          rf"http://127.0.0.1:{server.port}", log)
        assert ready, f"{name}: no ready line"
        tokens, concurrency = server.kv_capacity()
        assert (int(ready[1].replace(",", "")), float(ready[2])) == (tokens, concurrency), name
        loading = float(re.search(r"Loading weights took ([\d.]+) seconds", log)[1])
        assert loading < 10, name  # 14.4 MB; it used to log the host's uptime


def test_off_tpu_the_engine_core_is_forked_and_compiles_in_parallel():
    from tpu_models import host

    env = {}
    assert host.setup_host("cpu", env) == "cpu"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"  # no second import of vLLM
    assert int(env["NUM_PRECOMPILE_WORKERS"]) >= 1
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    mine = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "NUM_PRECOMPILE_WORKERS": "1"}
    host.setup_host("cpu", mine)
    assert mine["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and mine["NUM_PRECOMPILE_WORKERS"] == "1"
    on_tpu = {}
    assert host.setup_host("tpu", on_tpu) is None
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in on_tpu and "NUM_PRECOMPILE_WORKERS" not in on_tpu


def test_xla_cpu_threads_leave_the_engine_a_core_for_small_checkpoints(tmp_path):
    from tpu_models import host
    from tpu_models.server.serve import build_command

    assert host.xla_cpu_threads(14 << 20, 8) == 7 and host.xla_cpu_threads(14 << 20, 2) == 1
    assert host.xla_cpu_threads(14 << 20, 1) is None  # nothing to leave
    assert host.xla_cpu_threads(1200 << 20, 8) is None  # a 0.6B step needs every core
    assert host.xla_cpu_threads(None, 8) is None  # object storage, a hub name: unknown
    cores = len(os.sched_getaffinity(0))
    demo = str(cores - 1) if cores > 1 else None  # the demo: 14 MB
    assert build_command([], {})[1].get("NPROC") == demo
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "model.safetensors", "wb") as f:
        f.truncate(host.SMALL_CHECKPOINT_BYTES + 1)  # sparse: only its size is read
    assert "NPROC" not in build_command([str(big)], {})[1]
    (big / "model.safetensors").unlink()
    with open(big / "model.safetensors", "wb") as f:
        f.truncate(host.SMALL_CHECKPOINT_BYTES // 2)
    with open(big / "pytorch_model.bin", "wb") as f:  # a pickle beside it: never loaded
        f.truncate(host.SMALL_CHECKPOINT_BYTES // 2 + 1)
    assert build_command([str(big)], {})[1].get("NPROC") == demo
    assert build_command([], {"NPROC": "2"})[1]["NPROC"] == "2"  # the user's, kept
    assert "NPROC" not in build_command(["--device", "tpu"], {})[1]
    # host callbacks that run programs of their own, several devices: XLA's default
    for env in ({"TPU_MODELS_ATTENTION": "rpa-reference"}, {"TPU_MODELS_ATTENTION": "rpa-interpret"},
                {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
                {"JAX_NUM_CPU_DEVICES": "2"}):
        assert "NPROC" not in build_command([], env)[1], env
    assert build_command([], {"TPU_MODELS_ATTENTION": "portable"})[1].get("NPROC") == demo


def test_xla_cpu_sizes_its_pool_from_nproc():
    # What set_xla_cpu_threads relies on: XLA:CPU's pool (its threads are named
    # tf_XLAEigen) has NPROC threads.
    code = ("import os, jax; jax.devices(); print(sum(open(f'/proc/self/task/{t}/comm').read()"
            ".strip() == 'tf_XLAEigen' for t in os.listdir('/proc/self/task')))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "NPROC": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == "1"


@pytest.mark.e2e
def test_the_penalties_counts_are_allocated_before_the_kv_cache_is_sized(demo_server):
    # On the shared demo server (64 sequences, 1,024 ids): a request with a penalty uses
    # the counts start-up allocated, before the cache took its share; none come later.
    demo_server.client().completions.create(model="qwen3-structural-demo", prompt="Lena works",
                                            max_tokens=4, presence_penalty=0.5)
    log = demo_server.output()
    counts = re.findall(r"tpu-models: ([\d.]+) GiB a chip for the penalties' counts "
                        r"\((\d+) sequences x (\d+) ids\), allocated before the KV cache is sized",
                        log)
    assert [(n, ids) for _, n, ids in counts] == [("64", "1024")], counts
    assert log.index("for the penalties' counts") < log.index("KV cache size: ")
