"""Serving across hosts through tpu-inference's Ray executor, rehearsed on one machine:
`tpu-models serve --tensor-parallel-size 4 --local-hosts 2` starts two Ray nodes, each
a JAX process with two CPU devices, joined into one mesh. Greedy tokens equal
transformers' for both architectures (chunked prefill, a shared prefix, Gemma 3's
sliding window shorter than the prompts); a host killed mid-generation fails the
requests in flight, naming it, and stops the server."""

import re
import subprocess
import threading
import time

import numpy as np
import psutil
import pytest
import requests

from tpu_models.harness.serve_process import Server
from tests.test_serve_e2e import complete_all
from tests.tiny import Reference, make_gemma3, make_lora, make_qwen3

pytestmark = pytest.mark.e2e

COMMON = ("--local-hosts", "2", "--dtype", "float32", "--max-model-len", "256",
          "--kv-cache-memory-bytes", str(32 << 20), "--served-model-name", "tiny",
          # prompts up to 5 windows of Gemma 3's local layers, prefilled in chunks
          "--max-num-batched-tokens", "32", "--max-num-seqs", "16")
ACROSS_HOSTS = ("--tensor-parallel-size", "4", *COMMON)
# vLLM's data-parallel replicas on Ray nodes: one a host, tensor parallel 2 inside
REPLICAS = ("--tensor-parallel-size", "2", "--data-parallel-size", "2",
            "--data-parallel-backend", "ray", *COMMON)
# A local-hosts server is about 7 GB (below): it launches once that much is free
# beside the other worker's tests.
HEADROOM = 8 << 30


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    # Four query heads, one KV head: each host's two devices hold two query heads, and
    # the KV head is repeated on all four.
    qwen3 = make_qwen3(root / "qwen3", num_heads=4, num_kv_heads=1)
    return {"qwen3": qwen3, "adapter": make_lora(qwen3, root / "adapter", r=4, seed=1),
            "gemma3": make_gemma3(root / "gemma3", num_heads=4, num_kv_heads=1,
                                  sliding_window=16)}


@pytest.fixture(scope="module")
def qwen3_server(models, tmp_path_factory):
    """Qwen3 across two local hosts, with an adapter in LoRA slots chosen per request.
    Started when a test first asks for it: one local-hosts server runs at a time here
    (each is about 7 GB: a worker of about 2 GB a host, the engine, Ray's processes)."""
    server = Server(models["qwen3"], *ACROSS_HOSTS, "--enable-lora", "--max-lora-rank", "8",
                    "--lora-modules", f"adapter={models['adapter']}",
                    log=tmp_path_factory.mktemp("multihost-logs") / "qwen3.log",
                    headroom=HEADROOM)
    with server:
        yield server


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    shared = rng.integers(3, 384, 40).tolist()  # a template three of them share
    return ([rng.integers(3, 384, n).tolist() for n in (2, 11, 75)]
            + [shared + rng.integers(3, 384, n).tolist() for n in (3, 9, 20)])


def test_data_parallel_replicas_on_two_local_hosts(models, tmp_path):
    """vLLM's data-parallel replicas on the Ray nodes, a replica each."""
    from tests.test_data_parallel import served_by_engine

    with Server(models["qwen3"], *REPLICAS, log=tmp_path / "replicas.log",
                headroom=HEADROOM) as server:
        assert "replicas on 2 local hosts (Ray)" in server.output()  # the ready line
        reference = Reference(models["qwen3"])
        by_engine = {}
        # vLLM's balancer picks the replica with the shorter queue it knows of: a few
        # rounds of all at once give both some.
        for _ in range(3):
            got = complete_all(server, prompts() * 2, max_tokens=6)
            for prompt, ids in zip(prompts() * 2, got):
                assert ids == reference.greedy(prompt, 6), f"prompt of {len(prompt)}"
            by_engine = served_by_engine(server)
            if len(by_engine) == 2 and min(by_engine.values()) > 0:
                break
        assert sorted(by_engine) == ["0", "1"] and min(by_engine.values()) > 0, by_engine
        engines = set(re.findall(r"\(EngineCoreActor pid=(\d+)\)", server.output()))
        # each replica on its own node
        assert len({node_address(int(pid)) for pid in engines}) == 2, engines


def check_across_hosts(server, model) -> None:
    """One engine over both hosts' devices, whose greedy tokens are transformers'."""
    log = server.output()
    assert "Force using RayDistributedExecutorV2" in log
    assert "across 2 hosts (Ray)" in log  # the ready line
    # one mesh over both hosts' devices, one worker process a host
    assert "Mesh('data': 1, 'model': 4" in log
    ranks = set(re.findall(r"Init worker \| rank=(\d) \|", log))
    assert ranks == {"0", "1"}, ranks
    reference = Reference(model)
    got = complete_all(server, prompts(), max_tokens=6)  # all at once
    for prompt, ids in zip(prompts(), got):
        assert ids == reference.greedy(prompt, 6), f"prompt of {len(prompt)}"
    assert "[Gloo]" not in server.output()  # gloo's lines at each device's first collective


def test_gemma3_across_two_local_hosts(models, tmp_path):
    with Server(models["gemma3"], *ACROSS_HOSTS, log=tmp_path / "gemma3.log",
                headroom=HEADROOM) as server:
        assert "num_kv_cache_groups=6" in server.output()  # the hybrid KV cache, across hosts
        check_across_hosts(server, models["gemma3"])


def test_qwen3_and_a_lora_slot_across_two_local_hosts(qwen3_server, models):
    check_across_hosts(qwen3_server, models["qwen3"])
    adapted = Reference(models["qwen3"], adapter=models["adapter"])
    for prompt in prompts()[:3]:
        choice = qwen3_server.client().completions.create(
            model="adapter", prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
        assert choice.token_ids == adapted.greedy(prompt, 6), f"LoRA slot: {len(prompt)} tokens"


def node_address(pid: int) -> str:
    """The address of the Ray node whose raylet started process `pid`."""
    for process in psutil.Process(pid).parents():
        for arg in process.cmdline():
            if arg.startswith("--node_ip_address="):
                return arg.split("=", 1)[1]
    raise AssertionError(f"process {pid} was not started by a raylet")


def worker_pid(server, rank: int) -> int:
    """The process of host `rank`'s worker, from the server's log."""
    found = re.search(rf"RayWorkerProc pid=(\d+)\).*Init worker \| rank={rank} \|",
                      server.output())
    assert found, f"no worker of rank {rank} in the log"
    return int(found[1])


def test_a_lost_host_stops_the_server(qwen3_server):
    server = qwen3_server
    reply = {}

    def generate():
        reply["response"] = requests.post(
            f"{server.url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True,
                "temperature": 0})

    helpers = psutil.Process(server.process.pid).children(recursive=True)
    in_flight = threading.Thread(target=generate)
    in_flight.start()
    time.sleep(1)  # generating
    killed = time.monotonic()
    subprocess.run(["kill", "-9", str(worker_pid(server, 1))], check=True)
    in_flight.join(60)
    assert not in_flight.is_alive(), "the request in flight hung"
    response = reply["response"]
    assert response.status_code >= 500
    assert "lost host 1" in response.json()["error"]["message"], response.text
    assert not server.healthy()
    assert server.process.wait(60) != 0
    print(f"request failed, server exited {time.monotonic() - killed:.1f} s after the kill")
    assert "tpu-models serve: lost host 1" in server.output().strip().splitlines()[-1]
    # Its local hosts and their workers went with it: nothing holds them for a restart.
    gone, alive = psutil.wait_procs(helpers, timeout=30)
    assert not alive, [(p.pid, p.cmdline()[:3]) for p in alive]
