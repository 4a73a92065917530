"""tpu-inference's Ray executor across hosts: off-TPU stand-ins for libtpu; a lost host."""

from tpu_models.adapt.guard import EVERYWHERE, OFF_TPU, Feature, Patch, Target

ACROSS_HOSTS = Feature(
    "serving across hosts (TPU_MULTIHOST_BACKEND=ray; tpu-models serve --local-hosts)",
    lambda *_: _across_hosts(), "serve on one host")


def _across_hosts() -> bool:
    from tpu_models.multihost import serving_across_hosts
    return serving_across_hosts()


def worker_joins_jax_processes() -> None:
    # On a TPU slice libtpu joins every host's JAX process into one program; on CPU
    # each Ray worker would otherwise see only its own devices, and JAX's mesh over
    # the tensor-parallel size would not exist.
    from tpu_inference.worker.tpu_worker import TPUWorker

    from tpu_models import logs, multihost

    original = TPUWorker.__init__

    def __init__(self, vllm_config, local_rank, rank, *args, **kwargs):
        if multihost.serving_across_hosts():
            multihost.join_jax_processes(rank)
            logs.stdout_always_without(logs.GLOO_CONNECTED)  # each device's first collective
        original(self, vllm_config, local_rank, rank, *args, **kwargs)

    TPUWorker.__init__ = __init__


def hosts_ordered_by_process() -> None:
    # tpu-inference orders a slice's hosts by their chips' physical coordinates, which
    # CPU devices do not have; JAX numbers the processes in the same order.
    import tpu_inference.worker.tpu_worker as tpu_worker

    original = tpu_worker.get_device_topology_order_id

    def get_device_topology_order_id(local_devices, global_devices):
        if all(hasattr(d, "coords") for d in local_devices):
            return original(local_devices, global_devices)
        return local_devices[0].process_index

    tpu_worker.get_device_topology_order_id = get_device_topology_order_id


def weights_staged_on_this_hosts_cpu() -> None:
    # The loader stages each weight on "the CPU" before sharding it; on a TPU host
    # that backend is this process's alone, but off-TPU across hosts the CPU is the
    # joined one and its first device belongs to the first host.
    import functools

    import jax
    from jax.sharding import Mesh
    from tpu_inference.layers.common import utils

    @functools.cache
    def cpu_mesh():
        return Mesh(jax.local_devices(backend="cpu")[:1], ("cpu", ))

    utils.cpu_mesh = cpu_mesh


def engine_stops_when_a_host_is_lost() -> None:
    # vLLM's monitor sees a worker die and shuts the executor down, but the engine's
    # step goes on waiting for the lost host's reply (a socket read with no timeout):
    # the server hung, healthy, with its requests in flight. The engine process is
    # stopped instead, so the API server fails its requests and exits, naming the host
    # (noted before the shutdown kills the other hosts' workers too).
    import os
    import signal

    from tpu_inference.executors.ray_distributed_executor_v2 import RayDistributedExecutorV2
    from tpu_inference.logger import init_logger

    from tpu_models import multihost

    shutdown, register = (RayDistributedExecutorV2.shutdown,
                          RayDistributedExecutorV2.register_failure_callback)

    def noting_the_lost_host(self):
        if getattr(self, "is_failed", False) and not getattr(self, "shutting_down", True):
            message = f"lost {multihost.lost_hosts(self.ray_worker_handles)}: its worker died"
            init_logger("tpu_models.multihost").error(
                "tpu-models: %s; the engine stops, requests in flight fail and the server "
                "exits", message)
            multihost.record_lost(message)
        shutdown(self)

    def register_failure_callback(self, callback):
        def stop():
            callback()
            os.kill(os.getpid(), signal.SIGTERM)

        register(self, stop)

    RayDistributedExecutorV2.shutdown = noting_the_lost_host
    RayDistributedExecutorV2.register_failure_callback = register_failure_callback


def every_host_caches_its_programs() -> None:
    # JAX writes the persistent compilation cache from its first process only, and
    # another process's cache keys differ from the first's: every other host compiled
    # every program at every start. Off-TPU the local hosts share one disk, and each
    # writes entries under keys of its own.
    from jax._src import compilation_cache, compiler, config, distributed

    from tpu_models import multihost

    original = compiler._cache_write

    def _cache_write(cache_key, compile_time_secs, module_name, backend, executable):
        if (not multihost.serving_across_hosts() or distributed.global_state.process_id == 0
                or compile_time_secs < config.persistent_cache_min_compile_time_secs.value):
            return original(cache_key, compile_time_secs, module_name, backend, executable)
        compilation_cache.put_executable_and_time(
            cache_key, module_name, executable, backend, int(compile_time_secs))

    compiler._cache_write = _cache_write


PATCHES = [
    Patch("a Ray worker joins the other hosts' JAX processes", ACROSS_HOSTS, (
          Target("tpu_inference.worker.tpu_worker.TPUWorker.__init__",
                 "self vllm_config local_rank rank distributed_init_method is_driver_worker "
                 "devices ip prev_worker_ip"), ),
          "each host's worker saw only its own CPU devices: no mesh over the hosts",
          "tests/test_multihost.py::test_gemma3_across_two_local_hosts",
          worker_joins_jax_processes, platform=OFF_TPU),
    Patch("hosts ordered by JAX process where devices have no coordinates", ACROSS_HOSTS, (
          Target("tpu_inference.worker.tpu_worker.get_device_topology_order_id",
                 "local_devices global_devices"), ),
          "a worker's start-up ended in an AttributeError: CPU devices have no `coords`",
          "tests/test_multihost.py::test_gemma3_across_two_local_hosts",
          hosts_ordered_by_process, platform=OFF_TPU),
    Patch("weights staged on this host's own CPU device", ACROSS_HOSTS, (
          Target("tpu_inference.layers.common.utils.cpu_mesh", ""), ),
          "every host but the first failed to load a weight: 'cross-host reshard'",
          "tests/test_multihost.py::test_gemma3_across_two_local_hosts",
          weights_staged_on_this_hosts_cpu, platform=OFF_TPU),
    Patch("the engine stops when a host is lost", ACROSS_HOSTS, (
          Target("tpu_inference.executors.ray_distributed_executor_v2.RayDistributedExecutorV2"
                 ".register_failure_callback", "self callback"),
          Target("tpu_inference.executors.ray_distributed_executor_v2.RayDistributedExecutorV2"
                 ".shutdown", "self")),
          "a host's worker killed mid-generation left the server healthy and its requests "
          "waiting forever", "tests/test_multihost.py::test_a_lost_host_stops_the_server",
          engine_stops_when_a_host_is_lost, platform=EVERYWHERE),
    Patch("every local host writes its own compiled programs to the cache", ACROSS_HOSTS, (
          Target("jax._src.compiler._cache_write",
                 "cache_key compile_time_secs module_name backend executable"), ),
          "every host but the first compiled every program at every start (JAX caches the "
          "first process's programs only)",
          "tests/test_multihost.py::test_gemma3_across_two_local_hosts",
          every_host_caches_its_programs, platform=OFF_TPU, speed="tpu-models bench multihost"),
]
