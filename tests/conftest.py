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
# One thread per operation, XLA's and torch's (the references): two workers already
# keep both cores busy, so threads within an operation only wait on each other (two
# spec-decoding tests: 272 -> 244 s of CPU). XLA:CPU keeps its default optimization:
# at LLVM -O0 programs compiled a fifth faster but ran slower, and with the run's
# shared cache the suite runs programs more than it compiles them (the full suite
# without -O0: 3,300 -> 2,534 s of CPU, the same 414 passed). Compiles for a TPU
# (`tpu-models compile`) are left as users get them (tpu_compile_env).
CPU_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_XLA_FLAGS}".strip()
os.environ.setdefault("OMP_NUM_THREADS", "1")


def fake_devices(count: int) -> dict:
    """The environment of a process with `count` CPU devices (set before JAX starts)."""
    return {"XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={count}"}


def tpu_compile_env(env: dict) -> dict:
    return {**env, "XLA_FLAGS": env.get("XLA_FLAGS", "").replace(CPU_XLA_FLAGS, "").strip()}

import pytest  # noqa: E402

from tpu_models.harness import preloaded  # noqa: E402

# Servers and engine scripts fork from an interpreter that imported vLLM once per
# worker, saving each start 12-15 s of a core (harness/preloaded.py).
preloaded.ENABLED = True
DEMO_API_KEY = "test-key"
# demo_server's engine shape: the demo model's other servers take it too, so that their
# steps are programs the run's cache already holds.
DEMO_ENGINE = ("--max-model-len", "256", "--kv-cache-memory-bytes", str(256 << 20))


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One JAX compilation cache for every server and engine of the run, both
    workers': a program that another test compiled is read back, and nothing is
    read from or left in the user's cache (~/.cache/vllm). A VLLM_XLA_CACHE_PATH
    of the caller's own is kept (a warm cache across runs, for a quick loop)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's, above each worker's
    cache = base / "xla-cache"
    cache.mkdir(exist_ok=True)
    os.environ.setdefault("VLLM_XLA_CACHE_PATH", str(cache))
    # The tests' own processes too (the engine's runner turns it on in the engine's):
    # in-process steps of the shared tiny shapes are then compiled once per run.
    import jax
    jax.config.update("jax_compilation_cache_dir", os.environ["VLLM_XLA_CACHE_PATH"])


# The longest files (about two minutes or more each in a full run), longest first:
# the two workers take files in this order, then the rest alphabetically, so that no
# long file starts last while the other worker idles (xdist's own reordering, by
# test count, is turned off in pyproject.toml). Scheduling only; any order passes.
LONGEST_FIRST = ("test_spec_decode", "test_doctor", "test_sampler", "test_tunix_rollouts",
                 "test_quant", "test_compile", "test_wheel", "test_hybrid_kv_cache",
                 "test_attention", "test_multi_lora", "test_tpu_path", "test_object_storage",
                 "test_startup", "test_benchmarks", "test_data_parallel", "test_spec_fusion",
                 "test_tensor_parallel")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.module.__name__.rpartition(".")[2]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: a file's tests stay in order and together


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """`tpu-models serve` with no model (the embedded demo), as the README starts it, plus
    an API key; shared by the demo, request-validation, soak and benchmark smoke tests."""
    from tpu_models.harness.serve_process import Server
    log = tmp_path_factory.mktemp("demo-server") / "serve.log"
    with Server(None, *DEMO_ENGINE, log=log, api_key=DEMO_API_KEY,
                env={"SKIP_JAX_PRECOMPILE": "0"}) as server:
        yield server


# The tiny bases most modules share (the checkpoint fixtures are defined here only;
# a module that needs another shape names its own for what it is, e.g. gemma3_32k).
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from tests.tiny import make_qwen3
    return make_qwen3(tmp_path_factory.mktemp("qwen3"), num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from tests.tiny import make_gemma3
    return make_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="session")
def gemma3_ascii(tmp_path_factory):
    """A tiny Gemma 3 (5 local layers of window 16, then a global one) whose replies
    are ASCII: the (tied) embedding of every token that decodes to non-ASCII text is
    zero, so its logit is 0, below the best ASCII token's, and no reply ends inside a
    UTF-8 character (vLLM's detokenizer holds it back, transformers writes U+FFFD)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from tests.tiny import make_gemma3
    directory = make_gemma3(tmp_path_factory.mktemp("gemma3-ascii"), sliding_window=16)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    non_ascii = [i for i in range(len(tokenizer)) if not tokenizer.decode([i]).isascii()]
    assert len(non_ascii) >= 128, len(non_ascii)  # the high bytes, at least
    tensors = load_file(directory / "model.safetensors")
    tensors["model.embed_tokens.weight"][non_ascii] = 0
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="session")
def gemma3_server(gemma3_ascii, tmp_path_factory):
    """`tpu-models serve --dtype float32` of gemma3_ascii as "tiny", 512 tokens of
    context: Gemma 3 end to end (test_gemma3_e2e.py) and lm-eval's client (test_lm_eval.py)."""
    from tpu_models.harness.serve_process import Server
    log = tmp_path_factory.mktemp("gemma3-server") / "serve.log"
    with Server(gemma3_ascii, "--dtype", "float32", "--max-model-len", "512",
                "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "tiny",
                log=log) as server:
        yield server
