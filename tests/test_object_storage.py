"""Serving from Cloud Storage (gs://): a real storage server on loopback (fake-gcs-server),
the real `vllm serve`, weights streamed by vLLM's runai_streamer load format.

TPU_MODELS_TEST_BUCKET=gs://BUCKET[/PREFIX] runs the same tests against a real bucket
(tests/storage.py)."""

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from tpu_models.harness.serve_process import PLAIN_VLLM, Server
from tpu_models.loaders.hf import HfCheckpoint
from tpu_models.loaders.object_storage import ObjectStorageCheckpoint
from tpu_models.server.serve import build_command
from tests.storage import emulated_bucket
from tests.test_bad_checkpoints import edit_tensors
from tests.tiny import Reference, make_gemma3, make_qwen3, reshard

MAX_TOKENS = 6
# Small servers: the tiny models need little KV cache, and start faster for it.
OPTIONS = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes",
           str(64 << 20), "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def bucket():
    yield from emulated_bucket()


@pytest.fixture(scope="module")
def server_env(bucket, tmp_path_factory):
    # vLLM pulls config.json and the tokenizer into its assets cache: one per module run.
    return {**bucket.env, "VLLM_ASSETS_CACHE": str(tmp_path_factory.mktemp("vllm-assets"))}


def test_serve_streams_object_storage_and_points_every_client_at_the_emulator():
    command, env = build_command(["gs://b/m"], {"STORAGE_EMULATOR_HOST": "127.0.0.1:4443"})
    assert command[command.index("--load-format") + 1] == "runai_streamer"
    assert {k: env[k] for k in ("CLOUD_STORAGE_EMULATOR_ENDPOINT", "TENSORSTORE_GCS_HTTP_URL",
                                "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS")} == {
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": "http://127.0.0.1:4443",
        "TENSORSTORE_GCS_HTTP_URL": "http://127.0.0.1:4443",
        "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS": "true"}
    # A real bucket: the client libraries' own credentials; a load format given is kept.
    command, env = build_command(["s3://b/m", "--load-format", "auto"], {})
    assert command.count("--load-format") == 1 and "auto" in command
    assert not any(k.startswith(("RUNAI_STREAMER_GCS", "CLOUD_STORAGE")) for k in env)
    command, _ = build_command(["./m"], {})
    assert "--load-format" not in command


def test_our_models_take_the_weight_stream_under_model_impl_auto():
    """tpu-inference sends a model without a WeightLoader to vLLM's PyTorch path under
    --load-format runai_streamer; ours declare one."""
    from types import SimpleNamespace

    from tpu_inference.models.common.model_loader import resolve_model_architecture

    from tpu_models import plugin
    plugin.register()
    for name in ("Qwen3StructuralForCausalLM", "Gemma3ForCausalLM"):
        config = SimpleNamespace(load_config=SimpleNamespace(load_format="runai_streamer"),
                                 model_config=SimpleNamespace(
                                     hf_config=SimpleNamespace(architectures=[name])))
        assert resolve_model_architecture(config, False) == "flax_nnx", name


def test_headers_read_from_the_bucket_list_every_tensor(bucket, tmp_path, monkeypatch):
    for name, value in bucket.env.items():
        monkeypatch.setenv(name, value)
    checkpoint = reshard(make_qwen3(tmp_path / "sharded"))
    remote = ObjectStorageCheckpoint(bucket.upload(checkpoint), checkpoint)
    local = HfCheckpoint(checkpoint)
    assert len(remote.files) == 3
    assert ({n: (i.shape, i.dtype, i.file.name) for n, i in remote.tensors.items()} ==
            {n: (i.shape, i.dtype, i.file.name) for n, i in local.tensors.items()})


# A secret in every credential setting a client of ours might read: it must reach
# no log line and no file we write.
SENTINEL = "tpu-models-sentinel-4d1f0c2a"


def credentials(tmp_path) -> dict[str, str]:
    """Credential settings holding SENTINEL. The emulator takes none, so no client
    sends them anywhere; what is checked is that nothing repeats them."""
    key = tmp_path / "application-default-credentials.json"
    key.write_text(json.dumps({"type": "authorized_user", "client_id": SENTINEL,
                               "client_secret": SENTINEL, "refresh_token": SENTINEL}))
    return {"GOOGLE_APPLICATION_CREDENTIALS": str(key), "AWS_ACCESS_KEY_ID": SENTINEL,
            "AWS_SECRET_ACCESS_KEY": SENTINEL, "AWS_SESSION_TOKEN": SENTINEL,
            "CLOUDSDK_AUTH_ACCESS_TOKEN": SENTINEL}


def assert_nowhere(secret: str, places: list[Path]) -> None:
    for place in places:
        for file in [place] if place.is_file() else [p for p in place.rglob("*") if p.is_file()]:
            assert secret.encode() not in file.read_bytes(), f"{secret} written to {file}"


def greedy_ids(server, prompts, model="tiny"):
    client = server.client()
    return [client.completions.create(
        model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0].token_ids
        for p in prompts]


@pytest.mark.e2e
def test_tpu_models_serve_streams_qwen3_structural_from_gs(bucket, server_env, tmp_path):
    """Three shards streamed onto two (fake) devices, tensor parallel; adapters from
    gs:// given at start-up and loaded at runtime. Greedy ids equal transformers'
    (with peft for the adapters) in fp32."""
    import requests as http

    from tests.test_tensor_parallel import FOUR_DEVICES
    from tests.tiny import make_lora

    checkpoint = reshard(make_qwen3(tmp_path / "qwen3", num_heads=4, num_kv_heads=2))
    uri = bucket.upload(checkpoint)
    adapters = {name: make_lora(checkpoint, tmp_path / name, r=r, seed=seed)
                for name, r, seed in (("first", 4, 1), ("late", 8, 2))}
    uris = {name: bucket.upload(path) for name, path in adapters.items()}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 384, n).tolist() for n in (1, 9, 40)]
    with Server(uri, *OPTIONS, "--tensor-parallel-size", "2", "--enable-lora",
                "--max-lora-rank", "8", "--lora-modules", f"first={uris['first']}",
                log=tmp_path / "serve.log",
                env={**server_env, **FOUR_DEVICES, **credentials(tmp_path),
                     "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as s:
        log = s.output()
        assert f"streaming weights from {uri}" in log
        assert "Qwen3StructuralForCausalLM" in log
        r = http.post(f"{s.url}/v1/load_lora_adapter", headers=s.headers(), timeout=60,
                      json={"lora_name": "late", "lora_path": uris["late"]})
        assert r.status_code == 200, r.text
        # An adapter export killed before its manifest: a 400 naming it, still serving.
        cut = bucket.upload(adapters["late"], "cut-adapter")
        bucket.client.bucket(cut.split("/")[2]).blob(
            "/".join(cut.split("/")[3:] + ["tpu-models-export.incomplete"])).upload_from_string("{}")
        r = http.post(f"{s.url}/v1/load_lora_adapter", headers=s.headers(), timeout=60,
                      json={"lora_name": "cut", "lora_path": cut})
        assert r.status_code == 400 and f"{cut}: an unfinished export" in r.text, r.text
        for model, adapter in (("tiny", None), ("first", adapters["first"]),
                               ("late", adapters["late"])):
            reference = Reference(checkpoint, adapter=adapter)
            for prompt, ids in zip(prompts, greedy_ids(s, prompts, model)):
                assert ids == reference.greedy(prompt, MAX_TOKENS), (model, len(prompt))
    assert_nowhere(SENTINEL, [tmp_path / "serve.log", Path(server_env["VLLM_ASSETS_CACHE"])])


@pytest.mark.e2e
def test_plain_vllm_serve_streams_gemma3_from_gs(bucket, server_env, tmp_path):
    """Plain `vllm serve`, as a user on a TPU VM runs it. MODEL_IMPL_TYPE left at
    tpu-inference's default (auto): our models declare a WeightLoader, so the
    stream reaches them instead of vLLM's PyTorch path. A LoRA adapter merged
    while streaming and an EAGLE-3 draft come from gs:// too."""
    from tests.test_spec_decode import accepted_draft_tokens
    from tests.tiny import make_eagle3_draft, make_lora

    checkpoint = make_gemma3(tmp_path / "gemma3")
    adapter = make_lora(checkpoint, tmp_path / "adapter", r=4, seed=3)
    reference = Reference(checkpoint, adapter=adapter)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, reference.vocab_size, n).tolist() for n in (1, 9, 40)]
    expected = [reference.greedy(p, MAX_TOKENS) for p in prompts]
    propose = int(np.bincount(np.concatenate(expected)).argmax())
    draft = make_eagle3_draft(checkpoint, tmp_path / "draft", aux_layers=(0, 1, 3),
                              propose=propose)
    uri, adapter_uri, draft_uri = (bucket.upload(d) for d in (checkpoint, adapter, draft))
    spec = json.dumps({"method": "eagle3", "model": draft_uri, "num_speculative_tokens": 3})
    with Server(uri, *OPTIONS, "--load-format", "runai_streamer", "--host", "127.0.0.1",
                "--additional-config", json.dumps({"merge_lora": adapter_uri}),
                "--speculative-config", spec,
                command=PLAIN_VLLM,
                log=tmp_path / "serve.log",
                env={**server_env, "MODEL_IMPL_TYPE": "auto"}) as server:
        log = server.output()
        assert f"streaming weights from {uri}" in log
        assert f"merging LoRA {adapter_uri}" in log
        assert greedy_ids(server, prompts) == expected
        assert accepted_draft_tokens(server) > 0


@pytest.mark.e2e
def test_bad_checkpoint_in_gs_is_refused_before_streaming_naming_the_tensors(
        bucket, server_env, tmp_path):
    """The local name/shape checks, made on the headers read from the bucket: every
    fault is named with the gs:// URI, and no weight is streamed."""

    def damage(tensors):
        tensors.pop("model.layers.1.mlp.down_proj.weight")
        tensors["structural_head.bias"] = tensors["structural_head.bias"].repeat(2)

    uri = bucket.upload(edit_tensors(make_qwen3(tmp_path / "bad"), damage))
    server = Server(uri, *OPTIONS, log=tmp_path / "serve.log", env=server_env)
    assert server.wait_exit() != 0
    log = server.output()
    assert (f"{uri}: missing tensor model.layers.1.mlp.down_proj.weight (expected shape "
            "[64, 128]); tensor structural_head.bias in model.safetensors has shape [128], "
            "expected [64]") in log
    assert "streaming weights" not in log


@pytest.fixture
def in_bucket(bucket, monkeypatch):
    """This process pointed at the emulator, as the server's processes are."""
    for name, value in bucket.env.items():
        monkeypatch.setenv(name, value)
    return bucket


def test_faults_are_named_with_the_object_before_a_weight_moves(in_bucket, tmp_path):
    from tpu_models.loaders.hf import CheckpointError

    checkpoint = make_qwen3(tmp_path / "q")
    with pytest.raises(CheckpointError, match=r"^gs://no-such-bucket/m: .*(no such bucket|NotFound)"):
        ObjectStorageCheckpoint("gs://no-such-bucket/m", checkpoint)
    nothing = f"{in_bucket.root}/nothing-here"
    with pytest.raises(CheckpointError, match=rf"^{nothing}: no \*\.safetensors files"):
        ObjectStorageCheckpoint(nothing, checkpoint)
    # A file cut short: its object's size (listed with its generation) against its header.
    cut = tmp_path / "cut"
    cut.mkdir()
    data = (checkpoint / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) - 1000])
    uri = in_bucket.upload(cut)
    with pytest.raises(CheckpointError, match=rf"^{uri}/model.safetensors: truncated: tensor "
                                              rf".* but the file ends at {len(data) - 1000}"):
        ObjectStorageCheckpoint(uri, checkpoint)


def test_an_object_replaced_while_streamed_is_refused_naming_it(in_bucket, tmp_path):
    """Generations listed before the stream and after it: a shard uploaded again
    mid-stream (same bytes, new generation) fails the load, naming it."""
    from vllm.model_executor.model_loader.weight_utils import runai_safetensors_weights_iterator

    from tpu_models.loaders.hf import CheckpointError
    from tpu_models.loaders.object_storage import checked_stream

    checkpoint = reshard(make_qwen3(tmp_path / "q"))
    uri = in_bucket.upload(checkpoint, name="replaced")
    remote = ObjectStorageCheckpoint(uri, checkpoint)
    stream = checked_stream(runai_safetensors_weights_iterator(remote.files, False), remote)
    next(stream)
    in_bucket.upload(checkpoint, name="replaced")  # every shard again: new generations
    with pytest.raises(CheckpointError, match=rf"^{uri}/model-0000[123]-of-00003.safetensors: "
                                              r"replaced while its weights were read"):
        list(stream)
    # Unchanged, the same stream ends quietly with every tensor.
    remote = ObjectStorageCheckpoint(uri, checkpoint)
    names = [n for n, _ in checked_stream(
        runai_safetensors_weights_iterator(remote.files, False), remote)]
    assert sorted(names) == sorted(remote.tensors)


STREAM = """
import sys
from types import SimpleNamespace
from tpu_models import host
host.setup_host("cpu")
from vllm.model_executor.model_loader.weight_utils import runai_safetensors_weights_iterator
from tpu_models.loaders.hf import CheckpointError
from tpu_models.loaders.object_storage import ObjectStorageCheckpoint
from tpu_models.runtime import STREAMED, weight_stream

remote = ObjectStorageCheckpoint(sys.argv[1], sys.argv[2])
# The engine's stream, as our models' load_weights takes it (its read buffer included).
config = SimpleNamespace(load_config=SimpleNamespace(load_format=STREAMED))
stream = weight_stream(config, remote, runai_safetensors_weights_iterator(remote.files, False),
                       check_weights=False)
next(stream)
print("streaming", flush=True)
sys.stdin.readline()
list(stream)
"""


@pytest.mark.slow  # a process of its own, its storage server stopped
def test_a_storage_server_stopping_mid_load_is_named_within_a_minute(tmp_path):
    """The streamer's client retries a vanished server for 15 minutes, and waits for
    it again at exit; the stream notices within TPU_MODELS_STREAM_STALL_S, names the
    files not yet read, and the process leaves. In a process of its own, as in the
    engine."""
    import subprocess
    import time

    own = emulated_bucket()  # a server of its own, to stop
    bucket = next(own)
    checkpoint = reshard(make_qwen3(tmp_path / "q"))
    uri = bucket.upload(checkpoint)
    # Still pointed at the stopped emulator afterwards, never at a real endpoint.
    env = {**os.environ, **bucket.env, "TPU_MODELS_STREAM_STALL_S": "5"}
    process = subprocess.Popen([sys.executable, "-c", STREAM, uri, str(checkpoint)], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        lines = iter(process.stdout.readline, "")
        assert "streaming\n" in lines  # the library's chatter before it
        own.close()
        start = time.monotonic()
        process.stdin.write("\n")
        process.stdin.flush()
        try:
            output, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"still running after 60 s:\n{process.communicate()[0]}")
    finally:
        process.kill()
    assert time.monotonic() - start < 60
    assert process.returncode != 0
    assert re.search(rf"CheckpointError: {uri}/model-0000\d-of-00003.safetensors.*: the storage "
                     "server stopped answering while the weights were read", output), output


def test_lora_adapters_are_read_from_object_storage(in_bucket, tmp_path):
    from tpu_models.loaders.hf import CheckpointError
    from tpu_models.loaders.peft import LoraAdapter
    from tests.tiny import make_lora

    base = make_qwen3(tmp_path / "q")
    adapter = make_lora(base, tmp_path / "adapter", r=2)
    uri = in_bucket.upload(adapter)
    remote, local = LoraAdapter(uri), LoraAdapter(adapter)
    assert remote.directory == uri and remote.rank == local.rank == 2
    assert remote.alpha == local.alpha
    for name, (a, b) in local.targets.items():
        assert remote.targets[name][0].equal(a) and remote.targets[name][1].equal(b), name
    nowhere = f"{in_bucket.root}/no-adapter"
    with pytest.raises(CheckpointError, match=rf"^{nowhere}: nothing there \(looked for "
                                              "adapter_config.json"):
        LoraAdapter(nowhere)


@pytest.fixture
def s3_bucket(monkeypatch):
    """Bucket tpu-models-test on moto's S3 server on loopback, this process pointed at
    it (boto3 and the streamer's C++ client both read AWS_ENDPOINT_URL)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for name, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}",
                            "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                            # path-style URLs: the bucket is no host name on loopback
                            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}.items():
            monkeypatch.setenv(name, value)
        client = boto3.client("s3")
        client.create_bucket(Bucket="tpu-models-test")

        def upload(directory: Path, name: str) -> str:
            for file in sorted(directory.iterdir()):
                client.upload_file(str(file), "tpu-models-test", f"{name}/{file.name}")
            return f"s3://tpu-models-test/{name}"

        yield upload
    finally:
        server.stop()


@pytest.mark.slow  # processes of their own
def test_s3_checkpoints_are_checked_and_streamed_through_the_same_code(s3_bucket, tmp_path):
    """s3:// takes the gs:// path: headers read and checked, sizes against them, the
    stream (vLLM's runai iterator, as under --load-format runai_streamer) equal to
    the local files, an object replaced meanwhile refused (tests/s3_checks.py). In a
    process of its own, as in the engine: a process whose streamer has read gs://
    waits forever on its first s3:// read (the test suite's, never a server's)."""
    import subprocess

    command, _ = build_command(["s3://b/m"], {})
    assert command[command.index("--load-format") + 1] == "runai_streamer"
    checkpoint = reshard(make_qwen3(tmp_path / "q"))
    uri = s3_bucket(checkpoint, "ckpt")
    done = subprocess.run([sys.executable, "-m", "tests.s3_checks", uri, str(checkpoint)],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "all checks passed"
