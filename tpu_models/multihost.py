"""Serving across hosts, and local hosts that rehearse it on one machine.

Across hosts, tpu-inference's own Ray executor serves (TPU_MULTIHOST_BACKEND=ray:
RayDistributedExecutorV2, one Ray worker a host holding all its chips, one JAX
program over every host's devices). On a TPU slice libtpu joins the hosts' JAX
processes. Off-TPU nothing does, so each worker joins JAX's distributed runtime
itself (gloo collectives) at the coordinator named in its environment
(`join_jax_processes`, called by the seam when a worker is built). The rest of
what a slice has and CPU hosts do not is here too: each host's own CPU device to
stage weights on (`this_hosts_cpu_mesh`), and one compilation-cache key a program
on every host (`hash_devices_alike`), so that the first host compiles each program
and the others receive it (JAX's jax_share_binary_between_hosts). A host lost
mid-generation stops the engine, naming the host (`note_lost_host`,
`stopping_the_engine`).

`LocalHosts` starts N Ray nodes on this machine, each a "host" whose processes see
their own CPU devices, so that `tpu-models serve --local-hosts N` runs the same
executor and start-up path a slice runs. Everything stays on loopback.

Standard library only at import: `tpu-models serve` reads the names below before
it imports vLLM.
"""

import functools
import os
import re
import signal
import socket

# The executor tpu-inference picks for serving across hosts.
BACKEND_ENV, BACKEND = "TPU_MULTIHOST_BACKEND", "ray"
# Off-TPU, the worker joins JAX's processes at COORDINATOR (host:port of the first
# worker's JAX coordinator service), HOSTS of them in all.
COORDINATOR_ENV = "TPU_MODELS_JAX_COORDINATOR"
HOSTS_ENV = "TPU_MODELS_HOSTS"
# How long a host waits for the first host to compile a program it shares.
SHARE_WAIT_S = 600
# Set by `tpu-models serve --local-hosts`: the server process starts them.
LOCAL_HOSTS_ENV, HOST_DEVICES_ENV = "TPU_MODELS_LOCAL_HOSTS", "TPU_MODELS_HOST_DEVICES"
# Where the engine writes which host was lost, for the API server's errors and exit.
LOST_ENV = "TPU_MODELS_LOST_HOST_FILE"
DEVICES_FLAG = "--xla_force_host_platform_device_count"
# Ray elsewhere resolves "127.0.0.1" to this machine's outward address; with its
# cluster support off it keeps every node on loopback, which local hosts are.
RAY_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray's memory monitor kills a worker when the machine's memory is 95% used: local
# hosts share one machine with everything else on it, whose memory is not theirs
# to answer for (the kernel's OOM killer still guards the machine).
LOCAL_RAY = {"RAY_memory_monitor_refresh_ms": "0"}


def serving_across_hosts(env=os.environ) -> bool:
    return env.get(BACKEND_ENV) == BACKEND


def local_hosts(env=os.environ) -> int:
    return int(env.get(LOCAL_HOSTS_ENV) or 0)


def devices_per_host(tensor_parallel: int, hosts: int) -> int:
    """Each host's devices for a tensor-parallel size over `hosts` hosts, checked."""
    if hosts < 1 or tensor_parallel % hosts:
        raise ValueError(f"--tensor-parallel-size {tensor_parallel} does not split evenly over "
                         f"--local-hosts {hosts}: each host holds the same number of devices")
    return tensor_parallel // hosts


def with_devices(xla_flags: str, devices: int) -> str:
    """XLA_FLAGS asking for `devices` CPU devices, its other flags kept."""
    flags = re.sub(rf"{DEVICES_FLAG}=\d+", "", xla_flags).strip()
    return f"{flags} {DEVICES_FLAG}={devices}".strip()


def host_env(base: dict, index: int, devices: int, hosts: int) -> dict:
    """Local host `index`'s environment, for its Ray node and the workers it starts:
    `devices` CPU devices, and the TPU identity Ray's TPU support reads (type, name,
    worker, topology), else it asks the cloud metadata server, which must never be
    asked from a machine that is not a TPU VM."""
    return {
        "XLA_FLAGS": with_devices(base.get("XLA_FLAGS", ""), devices),
        "TPU_ACCELERATOR_TYPE": base.get("TPU_ACCELERATOR_TYPE", "v6e-1"),
        "TPU_NAME": base.get("TPU_NAME", "local"),
        "TPU_WORKER_ID": str(index),
        "TPU_TOPOLOGY": f"1x{devices * hosts}",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalHosts:
    """N Ray nodes on this machine, each with `devices` TPU resources standing for its
    CPU devices, kept by a process of their own (`python -m tpu_models.multihost`):
    Ray's client is not safe to fork, and the server forks its engine. The nodes stop
    when this process exits, however it exits (the keeper reads its stdin to EOF)."""

    def __init__(self, hosts: int, devices: int):
        self.hosts, self.devices = hosts, devices
        self.keeper, self.env = None, None

    def launch(self, env=os.environ) -> "LocalHosts":
        """Starts the keeper, which starts the nodes, and returns at once: the nodes
        come up while the caller imports vLLM (about 10 s of the start-up, on two
        cores). `joined` then waits for them, and points `env` at them."""
        import subprocess
        import sys

        env.update(RAY_LOOPBACK)
        self.env = env
        self.keeper = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.hosts), str(self.devices)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(env), text=True)
        return self

    def joined(self) -> str:
        """Waits for the nodes; the environment `launch` was given then points Ray's
        client, vLLM and the workers at them. Returns Ray's address."""
        import json

        env = self.env
        line = self.keeper.stdout.readline()
        if not line:
            raise SystemExit(f"tpu-models serve: --local-hosts {self.hosts}: the local Ray "
                             f"nodes did not start (exit {self.keeper.wait()}); see the "
                             f"lines above")
        address = json.loads(line)["address"]
        env["RAY_ADDRESS"] = address
        # vLLM binds the engine's placement group to the node at its own address.
        env["VLLM_HOST_IP"] = "127.0.0.1"
        env[COORDINATOR_ENV] = f"127.0.0.1:{free_port()}"
        env[HOSTS_ENV] = str(self.hosts)
        return address


def _keep(hosts: int, devices: int) -> None:
    """The keeper: starts the nodes, prints Ray's address, and stops them at stdin's EOF."""
    import json
    import signal
    import sys

    from ray.cluster_utils import Cluster

    # The server's process group is stopped with SIGTERM: the nodes are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    os.environ.update(LOCAL_RAY)  # the nodes' processes inherit it
    cluster = Cluster(shutdown_at_exit=True)
    try:
        for index in range(hosts):
            cluster.add_node(
                node_ip_address=f"127.0.0.{index + 1}", num_cpus=1, include_dashboard=False,
                resources={"TPU": devices},
                env_vars=host_env(os.environ, index, devices, hosts))
        print(json.dumps({"address": cluster.address}), flush=True)
        sys.stdin.read()
    finally:
        cluster.shutdown()


def lost_hosts(handles) -> str:
    """The hosts whose workers have died, named for a user: rank, Ray node and address,
    from the executor's worker handles (vLLM's RayWorkerHandle: rank, node_id, run_ref).
    Before the executor kills the others."""
    import ray

    nodes = {n["NodeID"]: n for n in ray.nodes()}
    lost = []
    for handle in handles:
        done, _ = ray.wait([handle.run_ref], timeout=0) if handle.run_ref else ([], [])
        if done:
            node = nodes.get(handle.node_id, {})
            lost.append(f"host {handle.rank} (Ray node {handle.node_id[:12]}, "
                        f"{node.get('NodeManagerAddress', 'address unknown')})")
    return ", ".join(lost) or "a host"


def record_lost(message: str, env=os.environ) -> None:
    """Notes a lost host where this server's processes read it (LOST_ENV), if set."""
    if path := env.get(LOST_ENV):
        with open(path, "w") as f:
            f.write(message)


def lost_message(env=os.environ) -> str | None:
    """What `record_lost` noted in this server, else None."""
    path = env.get(LOST_ENV)
    try:
        with open(path) as f:
            return f.read().strip() or None
    except (TypeError, FileNotFoundError):  # not set; nothing lost
        return None


def start_local_hosts(env=os.environ) -> LocalHosts | None:
    """The local hosts `tpu-models serve --local-hosts` asked for, launched (None:
    none); their `joined` waits for them."""
    if serving_across_hosts(env) and not env.get(LOST_ENV):
        import atexit
        import tempfile
        fd, env[LOST_ENV] = tempfile.mkstemp(prefix="tpu-models-lost-host-")
        os.close(fd)
        atexit.register(os.unlink, env[LOST_ENV])  # after the server has read it
    if not local_hosts(env):
        return None
    return LocalHosts(local_hosts(env), int(env[HOST_DEVICES_ENV])).launch(env)


def join_jax_processes(rank: int, env=os.environ) -> None:
    """Off-TPU, joins this worker's JAX process to the other hosts' (process `rank` of
    HOSTS, at COORDINATOR), with gloo collectives between them. Before anything opens
    a JAX backend in this process."""
    coordinator, hosts = env.get(COORDINATOR_ENV), env.get(HOSTS_ENV)
    if not coordinator or not hosts:
        raise RuntimeError(
            f"serving across hosts off-TPU: set {COORDINATOR_ENV} (host:port every host "
            f"reaches) and {HOSTS_ENV} (the number of hosts) for every host's Ray node; "
            "`tpu-models serve --local-hosts N` sets both")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=int(hosts), process_id=rank)
    # The first host compiles each program and the others receive it through the
    # distributed runtime (hash_devices_alike gives it one key on every host); a host
    # waits for one program at most SHARE_WAIT_S.
    jax.config.update("jax_share_binary_between_hosts", True)
    jax.config.update("jax_share_binary_between_hosts_timeout_ms", SHARE_WAIT_S * 1000)


@functools.cache
def this_hosts_cpu_mesh():
    """The mesh tpu-inference's loader stages each weight on ("the CPU") before
    sharding it: on a TPU host that backend is this process's alone, but off-TPU
    across hosts the CPU is the joined one and its first device belongs to the
    first host. This process's own first CPU device instead."""
    import jax
    from jax.sharding import Mesh
    return Mesh(jax.local_devices(backend="cpu")[:1], ("cpu", ))


def note_lost_host(handles) -> None:
    """Logs and records (`record_lost`) which host was lost, from the executor's
    worker handles, before its shutdown kills the other hosts' workers too."""
    from tpu_inference.logger import init_logger
    message = f"lost {lost_hosts(handles)}: its worker died"
    init_logger("tpu_models.multihost").error(
        "tpu-models: %s; the engine stops, requests in flight fail and the server exits",
        message)
    record_lost(message)


def stopping_the_engine(callback):
    """vLLM's failure callback, then this (the engine's) process stopped. vLLM's
    monitor sees a worker die and shuts the executor down, but the engine's step
    goes on waiting for the lost host's reply (a socket read with no timeout): the
    server hung, healthy, with its requests in flight. Stopped, the engine lets the
    API server fail its requests and exit, naming the host (`lost_message`)."""
    def stop():
        callback()
        os.kill(os.getpid(), signal.SIGTERM)

    return stop


def hash_devices_alike(hash_obj, devices) -> None:
    """What a program's compilation-cache key holds of its devices, the same on every
    host: their kinds and global ids. JAX hashes its backend's fingerprint of their
    topology, which off-TPU is each process's own view: every host's key for one
    program differed, and each host compiled every program itself (JAX's sharing
    waits for the first host's program under the waiting host's key)."""
    for device in devices.flat:
        hash_obj.update(f"{device.device_kind}:{device.id}".encode())


if __name__ == "__main__":
    import sys
    _keep(int(sys.argv[1]), int(sys.argv[2]))
