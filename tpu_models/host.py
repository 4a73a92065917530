"""Host set-up: what must hold before anything imports vLLM or tpu-inference.

Standard library only. `tpu-models serve`, `bench` and the tests call
`setup_host`; the adaptations (tpu_models.adapt) read `host_platform` in every
vLLM process.
"""

import glob
import os
import re

# tpu-inference reads these to describe the TPU slice; unset, it asks the cloud
# metadata server, which must never be contacted from a non-TPU host.
TPU_IDENTITY = {"TPU_ACCELERATOR_TYPE": "v6e-1", "TPU_NAME": "local", "TPU_WORKER_ID": "0"}
# --device values and the JAX platform each runs on (None: JAX's default, the TPU).
DEVICES = {"tpu": None, "cpu": "cpu", "gpu": "cuda"}


def has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*")) or os.path.exists("/dev/vfio")


def jax_platform(device: str = "auto", env=os.environ) -> str | None:
    """The JAX_PLATFORMS value to run with; None keeps JAX's TPU default."""
    if device == "auto":
        if env.get("JAX_PLATFORMS"):
            return env["JAX_PLATFORMS"]
        return None if has_tpu() else "cpu"
    return DEVICES[device]


def setup_host(device: str = "auto", env=None) -> str | None:
    """Prepares `env` (default: this process's environment) to run the stack on
    `device`: JAX_PLATFORMS and, off-TPU, a TPU identity. Returns the platform
    (None on TPU)."""
    env = os.environ if env is None else env
    platform = jax_platform(device, env)
    if platform is not None:
        env["JAX_PLATFORMS"] = platform
        set_tpu_identity(env)
        # Off-TPU the API server never opens a JAX backend, so the engine core can be
        # forked rather than spawned (no second import of vLLM; tpu-inference also
        # needs fork for attention backends registered by plugins).
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
        # XLA:CPU compiles are the start-up here: run them on every core.
        env.setdefault("NUM_PRECOMPILE_WORKERS", str(min(os.cpu_count() or 1, 8)))
    # JAX's persistent cache skips compilations under 1 s by default: most of ours.
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return platform


# XLA:CPU runs a step's operations on a pool of one thread per core; its NPROC
# variable sets the count. A small model's step is mostly the engine's Python
# work (inputs, dispatches, read-backs), and a pool on every core takes the core
# that work needs: the demo served with one thread on a 2-core host gave 1.19x
# (plain) and 1.14x (EAGLE-3) the output tok/s, while a 0.6B model's step took
# 36% longer (measured when it was adopted: commit a7d3f1b).
SMALL_CHECKPOINT_BYTES = 64 << 20
XLA_CPU_THREADS_ENV = "NPROC"


def xla_cpu_threads(checkpoint_bytes: int | None, cores: int) -> int | None:
    """XLA:CPU's pool size for a checkpoint of this many bytes (None: unknown) on
    this many cores: all but one for a small checkpoint; None keeps XLA's own."""
    if checkpoint_bytes is None or checkpoint_bytes > SMALL_CHECKPOINT_BYTES or cores < 2:
        return None
    return cores - 1


def set_xla_cpu_threads(env, checkpoint_bytes: int | None) -> None:
    """Off-TPU, sizes XLA:CPU's pool for the checkpoint unless `env` sets it. Not
    where programs must run at once on one pool: the RPA reference's and
    interpreter's host callbacks run programs of their own, which waited for the
    thread the step held (a hang), and fake devices' collectives wait for each other."""
    if (host_platform_of(env) != "cpu" or XLA_CPU_THREADS_ENV in env
            or attention_mode(env) != "portable"
            or fake_devices(env) > 1):
        return
    threads = xla_cpu_threads(checkpoint_bytes, len(os.sched_getaffinity(0)))
    if threads is not None:
        env[XLA_CPU_THREADS_ENV] = str(threads)


def fake_devices(env) -> int:
    """The CPU devices XLA_FLAGS or JAX_NUM_CPU_DEVICES ask JAX for (1: unset)."""
    flag = re.search(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
    return max(int(flag.group(1)) if flag else 1, int(env.get("JAX_NUM_CPU_DEVICES") or 1))


# `tpu-models compile`: this process builds the engine for a TPU topology (a
# tpu_models.topology.slices name) on whatever host it runs on, and compiles every
# program for it with libtpu; JAX itself stays on the host's CPU, nothing runs.
COMPILE_ENV = "TPU_MODELS_COMPILE_FOR"


def compile_target(env=None) -> str | None:
    env = os.environ if env is None else env
    return env.get(COMPILE_ENV) or None


def setup_compile(topology: str, env=None) -> None:
    """Prepares `env` (default: this process's) to compile for `topology`."""
    env = os.environ if env is None else env
    env[COMPILE_ENV] = topology
    env["JAX_PLATFORMS"] = "cpu"
    # The slice tpu-inference sees (it reads its generation from here), and libtpu's
    # own host discovery answered without a metadata server.
    env["TPU_ACCELERATOR_TYPE"] = topology
    env["TPU_WORKER_HOSTNAMES"] = "localhost"
    env["TPU_SKIP_MDS_QUERY"] = "1"
    # libtpu only compiles here (no chip is opened): compiles may run side by side,
    # and vLLM's helper processes load it too.
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    set_tpu_identity(env)


def set_tpu_identity(env) -> None:
    for key, value in TPU_IDENTITY.items():
        env.setdefault(key, value)


def host_platform() -> str | None:
    """The non-TPU JAX platform requested via JAX_PLATFORMS, else None (TPU or default)."""
    return host_platform_of(os.environ)


def host_platform_of(env) -> str | None:
    if compile_target(env):
        return None  # JAX runs on this host's CPU, but everything is built for the TPU
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if not platforms or "tpu" in platforms:
        return None
    return platforms[0]


# Which attention our models run: the portable kernel (off-TPU default), or
# tpu-inference's RPA backend and its cache layout as on a TPU, with the kernel
# itself (TPU default: "rpa"), its reference, or the kernel in JAX's interpreter.
ATTENTION_ENV = "TPU_MODELS_ATTENTION"
ATTENTION_MODES = {
    "portable": "tpu_models/attention.py, the cache laid out as RPA v3 lays it out",
    "rpa": "tpu-inference's RPA v3 Pallas kernel (TPU only)",
    "rpa-reference": "tpu-inference's RPA backend, its kernel replaced by its reference",
    "rpa-interpret": "tpu-inference's RPA backend, its Pallas kernel interpreted",
}
# rpa-interpret adapts the private callbacks of this JAX's Pallas TPU interpreter
# (tpu_models/kernels/rpa_interpret.py).
INTERPRETER_JAX = "0.11.2"


def _version(package: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


class AttentionModeError(ValueError):
    pass


def attention_mode(env=None) -> str:
    """TPU_MODELS_ATTENTION, checked; unset: "portable" off-TPU, "rpa" on a TPU."""
    env = os.environ if env is None else env
    value = env.get(ATTENTION_ENV, "").strip()
    off_tpu = host_platform_of(env) is not None
    if compile_target(env) and value not in ("", "rpa"):
        raise AttentionModeError(f"{ATTENTION_ENV}={value!r}: tpu-models compile compiles "
                                 "the TPU's own kernel (rpa); unset it")
    if not value:
        return "portable" if off_tpu else "rpa"
    if value not in ATTENTION_MODES:
        raise AttentionModeError(
            f"{ATTENTION_ENV}={value!r} is not an attention path: one of "
            + "; ".join(f"{name} ({what})" for name, what in ATTENTION_MODES.items()))
    if value == "rpa" and off_tpu:
        raise AttentionModeError(f"{ATTENTION_ENV}=rpa needs a TPU (the Pallas kernel compiles "
                                 "for TPUs only); off-TPU use rpa-reference")
    if value == "rpa-interpret" and (jax := _version("jax")) != INTERPRETER_JAX:
        raise AttentionModeError(
            f"{ATTENTION_ENV}=rpa-interpret cannot run: it adapts JAX {INTERPRETER_JAX}'s "
            f"Pallas TPU interpreter, this is JAX {jax}; use rpa-reference")
    return value
