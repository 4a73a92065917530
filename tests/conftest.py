"""Every test runs the real stack on this host's CPU, as `tpu-models serve` does."""

import os

from tpu_models import host  # imports nothing heavy

# Before anything imports tpu_inference: JAX on CPU, and a TPU identity so that
# tpu-inference never asks the cloud metadata server who it is.
host.setup_host("cpu")
os.environ.setdefault("MODEL_IMPL_TYPE", "flax_nnx")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Test servers compile the shapes they meet instead of every bucket up front
# (about 30 s less per start); the shared demo server below precompiles, as users get it.
os.environ.setdefault("SKIP_JAX_PRECOMPILE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import pytest  # noqa: E402

DEMO_API_KEY = "test-key"


def pytest_collection_modifyitems(config, items):
    """Two workers (pytest-xdist, `--dist loadgroup`: pyproject.toml) share the host's
    two cores; a server's start-up is mostly single-threaded. A module's tests run in
    one worker, so that its module-scoped servers start once, and the demo server's
    users in one, so that it does too."""
    for item in items:
        group = "demo-server" if "demo_server" in item.fixturenames else item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """`tpu-models serve` with no model (the embedded demo), as the README starts it, plus
    an API key; shared by the demo, request-validation, soak and benchmark smoke tests."""
    from tpu_models.harness.serve_process import Server
    log = tmp_path_factory.mktemp("demo-server") / "serve.log"
    with Server(None, "--max-model-len", "256", "--kv-cache-memory-bytes", str(256 << 20),
                log=log, api_key=DEMO_API_KEY, env={"SKIP_JAX_PRECOMPILE": "0"}) as server:
        yield server


# The tiny bases the LoRA tests (merged and per-request) share; a module that needs
# another shape defines its own fixture of the same name.
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from tests.tiny import make_qwen3
    return make_qwen3(tmp_path_factory.mktemp("qwen3"), num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from tests.tiny import make_gemma3
    return make_gemma3(tmp_path_factory.mktemp("gemma3"))
