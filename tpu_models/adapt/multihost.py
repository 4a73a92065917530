"""tpu-inference's Ray executor across hosts: off-TPU stand-ins for libtpu; a lost host."""

from tpu_models import logs, multihost
from tpu_models.features import ACROSS_HOSTS
from tpu_models.patching import EVERYWHERE, OFF_TPU, Patch, Target


def init_joining_jax_processes(original, self, vllm_config, local_rank, rank, *args,
                               **kwargs):
    """TPUWorker.__init__: across hosts off-TPU, the worker joins the other hosts' JAX
    processes first (on a slice libtpu does; else no mesh spans the hosts)."""
    if multihost.serving_across_hosts():
        multihost.join_jax_processes(rank)
        logs.stdout_always_without(logs.GLOO_CONNECTED)  # each device's first collective
    original(self, vllm_config, local_rank, rank, *args, **kwargs)


def order_by_process_without_coords(original, local_devices, global_devices):
    """get_device_topology_order_id: hosts are ordered by their chips' coordinates,
    which CPU devices do not have; JAX numbers the processes in the same order."""
    if all(hasattr(d, "coords") for d in local_devices):
        return original(local_devices, global_devices)
    return local_devices[0].process_index


def cpu_mesh_of_this_host(original):
    """cpu_mesh: this host's own CPU device, not the first host's (multihost)."""
    return multihost.this_hosts_cpu_mesh()


def shutdown_noting_the_lost_host(original, self):
    """RayDistributedExecutorV2.shutdown: a failed executor first names the lost host."""
    if getattr(self, "is_failed", False) and not getattr(self, "shutting_down", True):
        multihost.note_lost_host(self.ray_worker_handles)
    original(self)


def failure_stops_the_engine(original, self, callback):
    """RayDistributedExecutorV2.register_failure_callback: the engine's process stops
    after vLLM's callback (multihost.stopping_the_engine says why)."""
    original(self, multihost.stopping_the_engine(callback))


def one_key_on_every_host(original, hash_obj, accelerators):
    """jax._src.cache_key._hash_accelerator_config: across hosts off-TPU, a program's
    devices hashed alike on every host (multihost.hash_devices_alike says why)."""
    if not multihost.serving_across_hosts():
        return original(hash_obj, accelerators)
    multihost.hash_devices_alike(hash_obj, accelerators)


EXECUTOR = "tpu_inference.executors.ray_distributed_executor_v2.RayDistributedExecutorV2"
TWO_HOSTS = "tests/test_multihost.py::test_gemma3_across_two_local_hosts"
PATCHES = [
    Patch("a Ray worker joins the other hosts' JAX processes", ACROSS_HOSTS, (
          Target("tpu_inference.worker.tpu_worker.TPUWorker.__init__",
                 "self vllm_config local_rank rank distributed_init_method is_driver_worker "
                 "devices ip prev_worker_ip", init_joining_jax_processes), ),
          "each host's worker saw only its own CPU devices: no mesh over the hosts",
          TWO_HOSTS, platform=OFF_TPU),
    Patch("hosts ordered by JAX process where devices have no coordinates", ACROSS_HOSTS, (
          Target("tpu_inference.worker.tpu_worker.get_device_topology_order_id",
                 "local_devices global_devices", order_by_process_without_coords), ),
          "a worker's start-up ended in an AttributeError: CPU devices have no `coords`",
          TWO_HOSTS, platform=OFF_TPU),
    Patch("weights staged on this host's own CPU device", ACROSS_HOSTS, (
          Target("tpu_inference.layers.common.utils.cpu_mesh", "", cpu_mesh_of_this_host), ),
          "every host but the first failed to load a weight: 'cross-host reshard'",
          TWO_HOSTS, platform=OFF_TPU),
    Patch("the engine stops when a host is lost", ACROSS_HOSTS, (
          Target(f"{EXECUTOR}.register_failure_callback", "self callback",
                 failure_stops_the_engine),
          Target(f"{EXECUTOR}.shutdown", "self", shutdown_noting_the_lost_host)),
          "a host's worker killed mid-generation left the server healthy and its requests "
          "waiting forever", "tests/test_multihost.py::test_a_lost_host_stops_the_server",
          platform=EVERYWHERE),
    Patch("a program compiled once for every local host", ACROSS_HOSTS, (
          Target("jax._src.cache_key._hash_accelerator_config", "hash_obj accelerators",
                 one_key_on_every_host), ),
          "each host compiled every program itself: each process's cache key for a "
          "program differed",
          TWO_HOSTS, platform=OFF_TPU, speed="tpu-models bench multihost"),
]
