"""Serving from Cloud Storage (gs://): a real storage server on loopback (fake-gcs-server),
the real `vllm serve`, weights streamed by vLLM's runai_streamer load format.

TPU_MODELS_TEST_BUCKET=gs://BUCKET[/PREFIX] runs the same tests against a real bucket
(tests/storage.py)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from tpu_models.benchmarks.process import Server
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


def greedy_ids(server, prompts):
    client = server.client()
    return [client.completions.create(
        model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0].token_ids
        for p in prompts]


def assert_matches_transformers(server, checkpoint, seed):
    reference = Reference(checkpoint)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, reference.vocab_size, n).tolist() for n in (1, 9, 40)]
    for prompt, ids in zip(prompts, greedy_ids(server, prompts)):
        assert ids == reference.greedy(prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


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


@pytest.mark.e2e
def test_tpu_models_serve_streams_qwen3_structural_from_gs(bucket, server_env, tmp_path):
    """Three shards, streamed; greedy ids equal transformers' in fp32."""
    checkpoint = reshard(make_qwen3(tmp_path / "qwen3", num_heads=4, num_kv_heads=2))
    uri = bucket.upload(checkpoint)
    with Server(uri, *OPTIONS, log=tmp_path / "serve.log", env=server_env) as server:
        log = server.output()
        assert f"streaming weights from {uri}" in log
        assert "Qwen3StructuralForCausalLM" in log
        assert_matches_transformers(server, checkpoint, seed=0)


@pytest.mark.e2e
def test_plain_vllm_serve_streams_gemma3_from_gs(bucket, server_env, tmp_path):
    """Plain `vllm serve`, as a user on a TPU VM runs it. MODEL_IMPL_TYPE left at
    tpu-inference's default (auto): our models declare a WeightLoader, so the
    stream reaches them instead of vLLM's PyTorch path."""
    checkpoint = make_gemma3(tmp_path / "gemma3")
    uri = bucket.upload(checkpoint)
    with Server(uri, *OPTIONS, "--load-format", "runai_streamer", "--host", "127.0.0.1",
                command=[str(Path(sys.executable).parent / "vllm"), "serve"],
                log=tmp_path / "serve.log",
                env={**server_env, "MODEL_IMPL_TYPE": "auto"}) as server:
        log = server.output()
        assert f"streaming weights from {uri}" in log
        assert_matches_transformers(server, checkpoint, seed=1)


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
