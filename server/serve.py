"""`tpu-models serve`: the real `vllm serve`, set up for our models on any host.

On a TPU host it is `MODEL_IMPL_TYPE=flax_nnx vllm serve MODEL ...`. Elsewhere it
also points JAX at the host (JAX_PLATFORMS=cpu unless set) and gives
tpu-inference a TPU identity (tpu_models.host.setup_host), which switches on
the compatibility layer's host portability in every vLLM process. Everything
it does not know is passed to `vllm serve` unchanged.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from tpu_models.loaders.export_marker import check_export_complete
from tpu_models.loaders.hf import CheckpointError
from tpu_models.loaders.paths import model_path_problem
from tpu_models.loaders.object_storage import is_object_storage
from tpu_models.quant import qwix_rules as quant_rules
from tpu_models.server import middleware
from tpu_models import host, registry

DEFAULT_MODEL = Path(__file__).parent / "default_model"
DEFAULT_NAME = "qwen3-structural-demo"
# The demo model's EAGLE-3 draft (scripts/train_eagle3_draft.py).
EAGLE3_DRAFT = Path(__file__).parent / "default_model_eagle3"
# --speculative presets, as vLLM's --speculative-config.
SPECULATIVE = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2},
    # Four drafts: the draft is trained for four positions, and four beat three at
    # concurrency 1 (figures: benchmarks/README.md, "`bench spec`").
    "eagle3": {"method": "eagle3", "model": str(EAGLE3_DRAFT), "num_speculative_tokens": 4},
}
# Tokens per engine step off-TPU (vLLM's --max-num-batched-tokens, TPU default 2048).
CPU_BATCHED_TOKENS = 256
# Sequences per engine step off-TPU (vLLM's --max-num-seqs, default 256).
CPU_MAX_SEQS = 64
# A Cloud Storage emulator, as each client finds it: google-cloud-storage and gcsfs,
# the runai streamer's C++ client, tensorstore. Given one, serve sets the others.
GCS_EMULATOR = ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT",
                "TENSORSTORE_GCS_HTTP_URL")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tpu-models serve",
        usage="tpu-models serve [MODEL] [options] [vllm serve options]",
        description="Serve MODEL (an HF checkpoint directory or gs:// / s3:// prefix; default: "
                    "the embedded demo model) with vLLM's TPU backend: `vllm serve` with "
                    "MODEL_IMPL_TYPE=flax_nnx. Options not listed here go to `vllm serve` "
                    "unchanged (`vllm serve --help=all` lists them).",
        epilog="Defaults it applies: --host 127.0.0.1 (this machine only, unless you pass "
               "--host). On a host without a TPU also: JAX_PLATFORMS=cpu, --dtype float32 "
               f"(XLA:CPU bfloat16 matmuls are ~12x slower), --max-num-batched-tokens "
               f"{CPU_BATCHED_TOKENS}, --max-num-seqs {CPU_MAX_SEQS}, and a KV cache of "
               "--kv-cache-memory-bytes, else 20% of the host's memory in whole GiB. Any of "
               "them you pass wins.")
    p.add_argument("--device", choices=["auto", *host.DEVICES], default="auto",
                   help="where JAX runs (auto: TPU if this host has one, else CPU)")
    p.add_argument("--lora", metavar="ADAPTER_DIR",
                   help="merge this PEFT LoRA adapter into the weights while loading "
                        "(one adapter, no per-token cost; same as --additional-config "
                        "'{\"merge_lora\": ADAPTER_DIR}'). For several adapters chosen per "
                        "request use vLLM's --enable-lora --lora-modules NAME=DIR ...")
    p.add_argument("--check-weights", action="store_true",
                   help="refuse to start if a weight holds NaN or infinity, naming the tensor "
                        "(one extra pass over the weights while loading; same as "
                        "--additional-config '{\"check_weights\": true}')")
    p.add_argument("--quant", metavar="PRESET|RULES.yaml",
                   help="quantize with Qwix while loading: a preset "
                        f"({', '.join(quant_rules.preset_names())}) or a rules file; checked "
                        "before start-up, then passed as --additional-config "
                        "'{\"quantization\": {\"qwix\": {\"rules\": [...]}}}'")
    p.add_argument("--speculative", choices=sorted(SPECULATIVE),
                   help="speculative decoding (greedy output unchanged): ngram, prompt lookup "
                        "for any model; eagle3, the demo model's trained EAGLE-3 draft (for "
                        "another model pass vLLM's --speculative-config with its draft)")
    p.add_argument("--local-hosts", type=int, metavar="N",
                   help="rehearse serving across N hosts on this machine (off-TPU): N local "
                        "Ray nodes, each a JAX process with --tensor-parallel-size / N CPU "
                        "devices, served through tpu-inference's Ray executor as a multi-host "
                        "TPU slice is (docs/multi-host.md)")
    p.add_argument("--dry-run", action="store_true",
                   help="print, as shell lines that run it, the environment it would set "
                        "(export KEY=value) and the vllm command, instead of running it")
    return p


def build_command(argv: list[str], env: dict) -> tuple[list[str], dict]:
    argv = list(argv)
    model = argv.pop(0) if argv and not argv[0].startswith("-") else None
    args, vllm_args = parser().parse_known_args(argv)
    env = dict(env)
    env.setdefault("MODEL_IMPL_TYPE", "flax_nnx")
    # vLLM posts usage statistics to its own server unless told not to: nothing of
    # ours sends traffic the user did not ask for (VLLM_NO_USAGE_STATS=0 to allow it).
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    platform = host.setup_host(args.device, env)
    try:
        host.attention_mode(env)
    except host.AttentionModeError as e:
        raise SystemExit(f"tpu-models serve: {e}") from None
    if platform == "cpu" and not _given(vllm_args, "--dtype"):
        # XLA:CPU has no fast bfloat16 matmul (about 12x slower than float32 here).
        vllm_args += ["--dtype", "float32"]
    if platform is not None and not _given(vllm_args, "--max-num-batched-tokens"):
        # Start-up runs the model once at every token bucket up to this budget;
        # at TPU's 2048 a CPU spent minutes there for a 1B model (4,095 tokens of
        # forward passes), and a CPU gains nothing from larger chunks: a 0.6B
        # prefill costs 13-15 ms a token in steps of 128, 256 or 512 tokens.
        vllm_args += ["--max-num-batched-tokens", str(CPU_BATCHED_TOKENS)]
    if platform is not None and not _given(vllm_args, "--max-num-seqs"):
        # Start-up compiles the sampler and its helpers at every request bucket
        # up to this count (8, 16, ... 256 by default, the largest the slowest);
        # a CPU host is saturated long before 64 sequences a step.
        vllm_args += ["--max-num-seqs", str(CPU_MAX_SEQS)]
    if args.local_hosts:
        local_hosts(args.local_hosts, platform, vllm_args, env)
    emulated_storage(env)  # adapters and drafts may be in object storage too
    model, vllm_args = vllm_arguments(model, args, vllm_args)
    host.set_xla_cpu_threads(env, checkpoint_bytes(model))
    vllm_args += ["--middleware", "tpu_models.server.middleware.TpuModels"]
    if not _given(vllm_args, "--host"):
        vllm_args += ["--host", "127.0.0.1"]  # reachable from this machine only, unless asked
    env[middleware.URL_ENV] = f"http://{_value(vllm_args, '--host')}:{_value(vllm_args, '--port') or 8000}"
    command = [sys.executable, "-m", "tpu_models.server.vllm_main", "serve", model, *vllm_args]
    return command, env


def local_hosts(hosts: int, platform: str | None, vllm_args: list[str], env: dict) -> None:
    """--local-hosts: local hosts (Ray nodes) that tpu_models.server.vllm_main starts, and
    the engine across them: tpu-inference's Ray executor (TPU_MULTIHOST_BACKEND=ray) over
    the tensor-parallel devices split evenly among the hosts, or with vLLM's
    `--data-parallel-backend ray`, its replicas spread over the hosts, each on one."""
    from tpu_models import multihost
    if platform is None:
        raise ValueError("--local-hosts rehearses serving across hosts off-TPU; on a TPU "
                         "slice start Ray on every host instead (docs/multi-host.md)")
    tp = int(_value(vllm_args, "--tensor-parallel-size") or _value(vllm_args, "-tp") or 1)
    if _value(vllm_args, "--data-parallel-backend") == "ray":
        dp = int(_value(vllm_args, "--data-parallel-size") or _value(vllm_args, "-dp") or 1)
        if dp % hosts:
            raise ValueError(f"--data-parallel-size {dp} does not split evenly over "
                             f"--local-hosts {hosts}: each host serves the same replicas")
        devices = tp * (dp // hosts)
        if not _given(vllm_args, "--data-parallel-size-local"):
            vllm_args += ["--data-parallel-size-local", str(dp // hosts)]  # the head's share
    else:
        devices = multihost.devices_per_host(tp, hosts)
        env[multihost.BACKEND_ENV] = multihost.BACKEND
    env[multihost.HOST_DEVICES_ENV] = str(devices)
    env[multihost.LOCAL_HOSTS_ENV] = str(hosts)
    env.setdefault("RAY_DEDUP_LOGS", "0")  # each host's own lines, not "repeated 2x"
    # Every host's own devices (its node sets them too): XLA:CPU's pool stays whole, as
    # for fake devices, whose collectives wait for each other.
    env["XLA_FLAGS"] = multihost.with_devices(env.get("XLA_FLAGS", ""), devices)


def vllm_arguments(model: str | None, args: argparse.Namespace,
                   vllm_args: list[str]) -> tuple[str, list[str]]:
    """MODEL (default: the demo) and the `vllm serve` arguments our options stand for,
    on any platform (`tpu-models serve` and `compile` share them)."""
    vllm_args = list(vllm_args)
    if model is not None and is_object_storage(model) and not _given(vllm_args, "--load-format"):
        vllm_args += ["--load-format", "runai_streamer"]  # vLLM's way to object storage
    if model is None:
        model = str(DEFAULT_MODEL)
        if not _given(vllm_args, "--served-model-name"):
            vllm_args += ["--served-model-name", DEFAULT_NAME]
    if args.speculative:
        if args.speculative == "eagle3" and model != str(DEFAULT_MODEL):
            raise ValueError("--speculative eagle3 is the demo model's draft; for " + model +
                             " pass --speculative-config with an EAGLE-3 draft trained for it")
        if _given(vllm_args, "--speculative-config"):
            raise ValueError("give --speculative or --speculative-config, not both")
        vllm_args += ["--speculative-config", json.dumps(SPECULATIVE[args.speculative])]
    if args.lora:
        if _given(vllm_args, "--enable-lora"):
            raise ValueError("give --lora (one adapter merged at load) or --enable-lora "
                             "(adapters chosen per request), not both")
        adapter = args.lora if is_object_storage(args.lora) else os.path.abspath(args.lora)
        vllm_args = _with_additional_config(vllm_args, {"merge_lora": adapter})
    if args.check_weights:
        vllm_args = _with_additional_config(vllm_args, {"check_weights": True})
    if args.quant:
        vllm_args = _with_additional_config(vllm_args, quant_rules.additional_config(args.quant))
    return model, vllm_args


def checkpoint_bytes(model: str) -> int | None:
    """The size of a local checkpoint's weights, the safetensors files we load (a
    repository may ship pickles beside them); None where it is not a local
    directory (object storage, a hub name)."""
    path = Path(model)
    if is_object_storage(model) or not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def emulated_storage(env: dict) -> None:
    """With a Cloud Storage emulator named, every client is pointed at it, with
    anonymous credentials (the runai streamer's listing would otherwise ask
    google.auth.default() and fail). Without one: the client libraries' own
    credentials, untouched."""
    url = next((env[name] for name in GCS_EMULATOR if env.get(name)), None)
    if url is None:
        return
    url = url if "://" in url else f"http://{url}"  # STORAGE_EMULATOR_HOST may be host:port
    for name in GCS_EMULATOR:
        env.setdefault(name, url)
    env.setdefault("RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS", "true")


def _with_additional_config(args: list[str], extra: dict) -> list[str]:
    """Adds keys to --additional-config, keeping any JSON the user passed."""
    args, config = list(args), {}
    for i, arg in enumerate(args):
        if arg == "--additional-config" and i + 1 < len(args):
            config = json.loads(args[i + 1])
            del args[i:i + 2]
            break
        if arg.startswith("--additional-config="):
            config = json.loads(arg.split("=", 1)[1])
            del args[i]
            break
    return args + ["--additional-config", json.dumps({**config, **extra})]


def _given(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _value(args: list[str], flag: str) -> str | None:
    """The last value given for `flag` (`--flag V` or `--flag=V`), else None."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def check_model(model: str) -> None:
    """Refuses checkpoints we know we cannot serve, with what to do instead: an export
    cut short (before vLLM starts; the plugin checks again for plain `vllm serve`), a
    multimodal release."""
    if is_object_storage(model) or Path(model).is_dir():
        try:
            check_export_complete(model, CheckpointError)
        except CheckpointError as e:
            sys.exit(f"tpu-models serve: {e}")
    config = Path(model) / "config.json"
    if not config.exists():
        return
    name = (json.loads(config.read_text()).get("architectures") or [None])[0]
    if (arch := registry.for_multimodal(name)) is not None:
        sys.exit(f"tpu-models serve: {model} is a multimodal checkpoint ({name}); tpu-models "
                 f"serves its language model as text-only {arch.hf_name}. Extract it first:\n"
                 f"  tpu-models export {arch.multimodal.export_name} {model} "
                 f"--out {model.rstrip('/')}-text")


def check_model_path(model: str, vllm_args: list[str]) -> None:
    """A local MODEL that is no checkpoint vLLM could load, named before it starts (its
    own error, hundreds of lines later, was about Hugging Face repository ids)."""
    problem = model_path_problem(model, _value(vllm_args, "--load-format") == "dummy")
    if problem:
        raise ValueError(problem)


def check_adapters(model: str, lora: str | None, vllm_args: list[str]) -> None:
    """--lora and --lora-modules adapters read and checked before vLLM starts, against
    the base checkpoint's tensors where it is on this machine: seconds, where the
    engine refused them after compiling."""
    adapters = [("--lora", None, lora)] if lora else []
    adapters += [("--lora-modules", name, path) for name, path in _lora_modules(vllm_args)]
    local = [(flag, name, path) for flag, name, path in adapters if not is_object_storage(path)]
    if not local:
        return  # adapters in object storage: the engine reads and checks them
    from tpu_models.loaders.peft import LoraAdapter
    max_rank = int(_value(vllm_args, "--max-lora-rank") or 16)  # vLLM's default
    base = _tensor_shapes(model)
    for flag, name, path in local:
        named = f"{flag}: LoRA adapter {name!r}" if name else f"{flag}"
        if not Path(path).is_dir():
            raise ValueError(f"{named}: {path}: no such directory")
        try:
            adapter = LoraAdapter(path)
            if base:
                adapter.check_base(base)
        except CheckpointError as e:
            raise ValueError(f"{named}: {e}") from None
        if name and adapter.rank > max_rank:
            raise ValueError(f"{named}: {path}: rank r={adapter.rank} is above --max-lora-rank "
                             f"{max_rank} (pass --max-lora-rank {adapter.rank})")


def _tensor_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a local checkpoint's safetensors tensors (headers only)."""
    from safetensors import safe_open
    path = Path(model)
    if is_object_storage(model) or not path.is_dir():
        return {}
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "np") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def _lora_modules(vllm_args: list[str]) -> list[tuple[str, str]]:
    """(name, path) of each --lora-modules entry: NAME=PATH or vLLM's JSON form."""
    found, taking = [], False
    for arg in vllm_args:
        if arg.startswith("--lora-modules="):
            arg, taking = arg.split("=", 1)[1], True
        elif arg == "--lora-modules":
            taking = True
            continue
        elif arg.startswith("-"):
            taking = False
        if not taking:
            continue
        if arg.lstrip().startswith("{"):
            entry = json.loads(arg)
            found.append((entry.get("name"), entry.get("path")))
        elif "=" in arg:
            found.append(tuple(arg.split("=", 1)))
    return found


def prepare(argv: list[str]) -> tuple[list[str], dict]:
    """vLLM's command line and environment for `tpu-models serve ARGV`, the model and
    adapters checked; this process's environment updated to it. Exits naming the fault."""
    try:
        command, env = build_command(argv, os.environ)
        model, vllm_args = command[4], command[5:]
        check_model_path(model, vllm_args)
        check_adapters(model, _value(argv, "--lora"), vllm_args)
    except (quant_rules.RulesError, ValueError) as e:
        sys.exit(f"tpu-models serve: {e}")
    os.environ.update(env)  # the storage emulator's settings, if any; exec'd with them next
    check_model(command[4])
    return command, env


def main(argv: list[str]) -> None:
    before = dict(os.environ)
    command, env = prepare(argv)
    if "--dry-run" in argv:
        print(dry_run(command, env, before))
        return
    os.execvpe(command[0], command, env)


def dry_run(command: list[str], env: dict, before: dict) -> str:
    """What serve would run, as shell lines that run it: the environment it sets
    (`export KEY=value`), then the command, each word quoted."""
    import shlex
    changed = {k: v for k, v in env.items() if before.get(k) != v}
    lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(changed.items())]
    return "\n".join([*lines, shlex.join(command)])
