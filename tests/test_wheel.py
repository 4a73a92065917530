"""The wheel, tested as a user installs it.

Built from this tree, installed (not editable) with its dependencies into a fresh
virtual environment, then run from there with a working directory outside the
repository (whose folders would otherwise shadow the installed package):

- no generic top-level name (`server`, `loaders`, `quant`, `benchmarks`) is importable;
- `tpu-models serve` (the embedded demo) answers the README's request;
- `tpu-models serve --speculative eagle3` starts: its draft ships in the wheel;
- plain `MODEL_IMPL_TYPE=flax_nnx vllm serve` serves the installed demo model, an
  architecture vLLM does not know: the `vllm.general_plugins` entry point registered it.

The install is uv's, pinned to the versions of the dev environment (.venv): a
cache hit, hardlinked from uv's cache (3-7 s for 10 GB). It compiles no
bytecode (`--compile-bytecode` over all of it costs ~100 s on a 2-core host);
the servers write what they import, as on a first run. XLA's compile cache and
flags are the suite's (tests/conftest.py): the servers read back what the suite's
demo servers of the same configurations compiled, and leave nothing in the user's
cache (~/.cache/vllm).
"""

import configparser
import json
import os
import shutil
import signal
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tpu_models.benchmarks import serving
from tpu_models.harness.serve_process import Server, launched
from tests.conftest import DEMO_ENGINE

pytestmark = pytest.mark.e2e

REPO = Path(__file__).parents[1]
GENERIC_NAMES = ("server", "loaders", "quant", "benchmarks")
DEMO_NAME = "qwen3-structural-demo"
# What a user on a CPU host sets (tests/conftest.py; tpu_models.host.setup_host).
HOST_ENV = {
    "JAX_PLATFORMS": "cpu", "TPU_ACCELERATOR_TYPE": "v6e-1", "TPU_NAME": "local",
    "TPU_WORKER_ID": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    # Compile the shapes met instead of every bucket up front (as the suite does).
    "SKIP_JAX_PRECOMPILE": "1",
}
# Set by this test process (conftest, .venv) and not by a user's shell.
NOT_INHERITED = ("VLLM_", "TPU_", "JAX_", "XLA_", "NUM_PRECOMPILE_WORKERS", "MODEL_IMPL_TYPE",
                 "PYTHON", "VIRTUAL_ENV", "UV_")
# The README's "Serving" request.
README_MESSAGE = "Lena works as a baker at Contoso for 3 years"


def find_uv() -> str:
    """uv as ./dev finds or installs it (PATH, else `pip install --user uv`)."""
    for candidate in (shutil.which("uv"), Path(site.getuserbase()) / "bin" / "uv"):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("uv not found on PATH or in the user base (./dev installs it)")


def run(command, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, (
        f"{command} exited with {result.returncode}:\n{result.stdout[-4000:]}\n"
        f"{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("wheel")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # a 10 GB venv (hardlinks, mostly)


@pytest.fixture(scope="module")
def wheel(workdir) -> Path:
    """Built from a copy of the tree: setuptools writes build/ and *.egg-info into the
    source, and a stale build/lib would ship files deleted since."""
    source = workdir / "source"
    shutil.copytree(REPO, source, ignore=untracked)
    started = time.monotonic()
    run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
         str(workdir / "dist"), str(source)])
    print(f"\nwheel built in {time.monotonic() - started:.1f}s")
    (built, ) = (workdir / "dist").glob("tpu_models-*.whl")
    return built


def untracked(folder: str, names: list[str]) -> set[str]:
    """What .gitignore ignores: no build output or environment goes into the copy."""
    ignored = {n for n in names if n in ("__pycache__", "build") or n.endswith(".egg-info")}
    if Path(folder) == REPO:
        ignored |= {".git", ".venv", ".pytest_cache", "out", ".whl"} & set(names)
    return ignored


def user_env(venv: Path, **extra) -> dict:
    """A user's shell with the venv activated, on this CPU host."""
    dev_bin = str(Path(sys.prefix) / "bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith(NOT_INHERITED)}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != dev_bin]
    env.update(PATH=os.pathsep.join([str(venv / "bin"), *path]), VIRTUAL_ENV=str(venv),
               **HOST_ENV, **extra)
    return env


def server_env(venv: Path, **extra) -> dict:
    """user_env, with the suite's compilation cache and XLA flags (see above)."""
    return user_env(venv, **extra, **{k: os.environ[k] for k in ("VLLM_XLA_CACHE_PATH",
                                                                 "XLA_FLAGS")})


@pytest.fixture(scope="module")
def venv(workdir, wheel) -> Path:
    uv = find_uv()
    venv = workdir / "venv"
    # The dev environment's versions, so that uv resolves nothing new (all cached).
    frozen = run([uv, "pip", "freeze", "--python", sys.executable]).stdout.splitlines()
    constraints = workdir / "constraints.txt"
    constraints.write_text("\n".join(
        line for line in frozen
        if not line.startswith("-e ") and not line.lower().replace("_", "-").startswith(
            "tpu-models")) + "\n")
    uv_env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    uv_env.pop("VIRTUAL_ENV", None)
    started = time.monotonic()
    # The interpreter .venv was made from (Python 3.12); never a downloaded one.
    run([uv, "venv", "--quiet", "--python", sys._base_executable, "--python-preference",
         "only-system", str(venv)], env=uv_env)
    run([uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
         "-c", str(constraints), str(wheel)], env=uv_env)
    print(f"venv installed in {time.monotonic() - started:.1f}s")
    return venv


def site_packages(venv: Path) -> Path:
    (path, ) = (venv / "lib").glob("python3.*/site-packages")
    return path


def test_wheel_holds_one_import_root_and_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    roots = {name.split("/")[0] for name in names}
    dist_info = {r for r in roots if r.endswith(".dist-info")}
    assert roots - dist_info == {"tpu_models"} and len(dist_info) == 1, sorted(roots)
    for model in ("default_model", "default_model_eagle3", "doctor_models/qwen3-structural",
                  "doctor_models/gemma3"):
        for file in ("config.json", "model.safetensors", "tokenizer.json"):
            assert f"tpu_models/server/{model}/{file}" in names
    assert "tpu_models/server/doctor_models/expected.json" in names  # tpu-models doctor
    for data in ("demo_free_held_out.json", "demo_template_held_out.json"):  # demo_quality
        assert f"tpu_models/benchmarks/data/{data}" in names
    assert not any("demo_phrasing" in n or "random_checkpoints" in n and "harness" not in n
                   for n in names)  # the demo's training generators stay in scripts/
    presets = {p.name for p in (REPO / "quant" / "presets").glob("*.yaml")}
    assert presets and {n.split("/")[-1] for n in names
                        if n.startswith("tpu_models/quant/presets/")} == presets
    (dist_info, ) = dist_info
    entry_points = configparser.ConfigParser()
    entry_points.read_string(zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode())
    assert entry_points["console_scripts"]["tpu-models"] == "tpu_models.server.cli:main"
    assert entry_points["vllm.general_plugins"]["tpu_models"] == "tpu_models.plugin:register"
    assert entry_points["tpu_models.commands"]["bench"] == "tpu_models.benchmarks.dispatch:main"


CHECK_IMPORTS = """
import importlib, json
from importlib.metadata import entry_points
for name in {names!r}:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        assert e.name == name, e
    else:
        raise SystemExit(f"import {{name}}: importable")
import tpu_models, tpu_models.server.serve
print(json.dumps({{
    "tpu_models": tpu_models.__file__, "serve": tpu_models.server.serve.__file__,
    "plugins": {{e.name: e.value for e in entry_points(group="vllm.general_plugins")}}}}))
"""


def test_installed_package_has_no_generic_top_level_names(venv, workdir):
    result = run([str(venv / "bin" / "python"), "-c", CHECK_IMPORTS.format(names=GENERIC_NAMES)],
                 env=user_env(venv), cwd=workdir)
    found = json.loads(result.stdout.splitlines()[-1])
    installed = site_packages(venv) / "tpu_models"
    assert Path(found["tpu_models"]) == installed / "__init__.py"
    assert Path(found["serve"]) == installed / "server" / "serve.py"
    assert found["plugins"]["tpu_models"] == "tpu_models.plugin:register"


@pytest.fixture(scope="module")
def servers(venv, workdir):
    """The three servers, launched at once (a start is mostly vLLM's single-threaded
    import), from a directory outside the repository; all stopped at the end."""
    cwd = workdir / "cwd"
    cwd.mkdir()
    chdir = ["env", f"--chdir={cwd}"]  # Server runs its command in the repository
    bin_ = venv / "bin"
    default_model = site_packages(venv) / "tpu_models" / "server" / "default_model"
    assert (default_model / "model.safetensors").is_file()
    plain_env = server_env(venv, MODEL_IMPL_TYPE="flax_nnx")
    specs = {
        "demo": Server(None, *DEMO_ENGINE, command=[*chdir, str(bin_ / "tpu-models"), "serve"],
                       log=workdir / "demo.log"),
        # As tests/test_spec_decode.py's EAGLE-3 server: the same programs.
        "eagle3": Server(None, *DEMO_ENGINE, "--speculative", "eagle3",
                         command=[*chdir, str(bin_ / "tpu-models"), "serve"],
                         log=workdir / "eagle3.log"),
        "plain": Server(default_model, *DEMO_ENGINE, "--dtype", "float32",
                        "--max-num-batched-tokens", "256", "--max-num-seqs", "16",
                        "--host", "127.0.0.1", "--served-model-name", DEMO_NAME,
                        command=[*chdir, str(bin_ / "vllm"), "serve"],
                        log=workdir / "plain.log"),
    }
    for name, server in specs.items():
        # Server adds this process's environment (the suite's settings): a user's instead.
        server.env = plain_env if name == "plain" else server_env(venv)
    started = time.monotonic()
    with launched(specs):
        yield specs
        print(f"\nservers up and answered in {time.monotonic() - started:.1f}s (start-ups: "
              + ", ".join(f"{n} {getattr(s, 'startup_seconds', 0):.0f}s" for n, s in specs.items())
              + ")")
    leftovers = {}
    for name, server in specs.items():
        if server.process is None:
            continue
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and process_group_alive(server.process.pid):
            time.sleep(0.2)
        if process_group_alive(server.process.pid):
            os.killpg(server.process.pid, signal.SIGKILL)
            leftovers[name] = server.process.pid
    assert not leftovers, f"processes left after SIGTERM (killed): {leftovers}"


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def readme_request(server: Server) -> dict:
    """The README's "Serving" request; its reply must be the JSON for Lena."""
    server.start()
    reply = server.client().chat.completions.create(
        model=DEMO_NAME, temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": README_MESSAGE}])
    text = reply.choices[0].message.content
    answer = json.loads(text)
    assert answer["name"] == "Lena", text
    return answer


def test_tpu_models_serve_answers_the_readme_request(servers):
    readme_request(servers["demo"])


def test_eagle3_draft_ships_in_the_wheel(servers):
    readme_request(servers["eagle3"])
    accepted = "vllm:spec_decode_num_accepted_tokens_total"
    assert serving.server_counters(servers["eagle3"].url, [accepted])[accepted] > 0


def test_plain_vllm_serve_loads_the_plugin(servers):
    """Qwen3StructuralForCausalLM is unknown to vLLM: it serves only if the
    `vllm.general_plugins` entry point of the installed wheel registered it."""
    server = servers["plain"]
    readme_request(server)
    assert "Qwen3StructuralForCausalLM" in server.output()
