"""`tpu-models doctor`: what this host runs, and whether both architectures serve right.

Prints the platform and its devices, the versions of the stack, the attention
path, which of our adaptations apply and which features are refused; then
serves the two tiny checkpoints shipped in doctor_models/ (Qwen3-structural;
Gemma 3 with sliding windows and soft caps) through `tpu-models serve` and
compares their greedy tokens with transformers' (fp32, computed when the
checkpoints were made: scripts/make_doctor_models.py).

With --topology NAME it compiles instead of serving: both checkpoints, every
program their start-up compiles, for that TPU slice, by the TPU compiler
(`tpu-models compile`), on any host.

Exit status: 0 all equal (or compiled); 1 a mismatch (or a program that does
not compile); 2 it could not run. The last line says why.
The facts come from a child process: on a TPU host the process that opens the
chips keeps them, and the servers need them.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

from tpu_models.server.loopback import ServeProcess

MODELS = Path(__file__).parent / "doctor_models"
PACKAGES = ("vllm-tpu", "tpu-inference", "jax", "jaxlib", "libtpu", "flax", "qwix", "tpu-models")
# Small enough for any host: 32-token chunks make the longer prompts chunked prefills.
# 8 MiB holds every sequence at --max-model-len; JAX's Pallas interpreter
# (rpa-interpret) copies the whole cache at each call, so more only costs time.
ENGINE_ARGS = ("--max-model-len", "256", "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
               "--kv-cache-memory-bytes", str(8 << 20))
SERVER_ARGS = ("--dtype", "float32", *ENGINE_ARGS, "--served-model-name", "doctor")


class CannotRun(Exception):
    """Exit 2: the check itself could not run (not a wrong answer)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tpu-models doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=Path, default=MODELS,
                   help="checkpoints and expected.json (default: the shipped ones)")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds a server may take to become ready, and its replies "
                        "(default 300)")
    p.add_argument("--keep-logs", type=Path, metavar="DIR",
                   help="write the servers' logs here (default: a temporary directory, "
                        "kept and named on failure)")
    p.add_argument("--topology", metavar="NAME",
                   help="compile both checkpoints for this TPU slice (v5e-1, v6e-8, ...) "
                        "with the TPU compiler instead of serving them; any host")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    return p


# --- facts (in a child process) -------------------------------------------------

def probe() -> dict:
    """Platform, devices, attention path and the seam's assessment, as JSON."""
    from tpu_models import host
    platform = host.setup_host()
    mode = host.attention_mode()  # AttentionModeError: reported by the parent
    import jax

    from tpu_models import adapt
    features = adapt.assessment()
    devices = jax.devices()
    return {"platform": platform or devices[0].platform, "off_tpu": platform is not None,
            "devices": [f"{d.device_kind} ({d.platform}:{d.id})" for d in devices],
            "attention": mode, "features": features,
            "tpu_inference": adapt.upstream_version(), "written_for": adapt.WRITTEN_FOR}


def facts(env: dict) -> dict:
    command = [sys.executable, "-m", "tpu_models.server.doctor", "--probe"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CannotRun(f"could not inspect this host: {last}")
    return json.loads(lines[-1])


def versions() -> str:
    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"
    return ", ".join(f"{name} {version(name)}" for name in PACKAGES)


# --- serving ---------------------------------------------------------------------

class Served(ServeProcess):
    """One `tpu-models serve` of a shipped checkpoint, on loopback."""

    def __init__(self, name: str, directory: Path, logs: Path, env: dict):
        from tpu_models.server import serve
        super().__init__(logs / f"{name}.log")
        self.name = name
        command, env = serve.build_command(
            [str(directory), *SERVER_ARGS, "--port", str(self.port)], env)
        self.launch(command, env)

    def wait_ready(self, timeout: float) -> float:
        while time.monotonic() - self.started < timeout:
            if self.exited():
                raise CannotRun(f"{self.name}: the server stopped before it was ready "
                                f"({self.last_error()}); log: {self.log_path}")
            if self.healthy(timeout=5):
                return time.monotonic() - self.started
            time.sleep(0.5)
        raise CannotRun(f"{self.name}: not ready after {timeout:.0f} s; log: {self.log_path}")

    def greedy(self, prompt: list[int], tokens: int, timeout: float) -> list[int]:
        body = {"model": "doctor", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        request = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return json.loads(r.read())["choices"][0]["token_ids"]
        except (urllib.error.URLError, OSError, KeyError) as e:
            raise CannotRun(f"{self.name}: a request failed ({e}); log: {self.log_path}") from None

    def last_error(self) -> str:
        lines = [l.strip() for l in self.output().splitlines() if l.strip()]
        errors = [l for l in lines if "Error" in l or "error" in l]
        return (errors or lines or ["no output"])[-1][-300:]


def mismatches(name: str, expected: dict, got: list[list[int]]) -> list[str]:
    """One line per prompt whose greedy tokens differ from the reference's."""
    out = []
    for i, (prompt, want, have) in enumerate(zip(expected["prompts"], expected["greedy"], got)):
        if have != want:
            first = next((k for k, (a, b) in enumerate(zip(have, want)) if a != b), len(have))
            out.append(f"{name}: prompt {i} ({len(prompt)} tokens) differs from transformers "
                       f"at token {first}: got {have}, expected {want} (the reference's "
                       f"least top-2 margin was {expected['margins'][i]} logits)")
    return out


def check_models(models: Path, env: dict, logs: Path, timeout: float, in_parallel: bool,
                 say) -> list[str]:
    expected = json.loads((models / "expected.json").read_text())
    names = [n for n in ("qwen3-structural", "gemma3") if (models / n).is_dir()]
    if not names:
        raise CannotRun(f"no checkpoints in {models}")

    def check(server: Served) -> tuple[float, list[list[int]]]:
        ready = server.wait_ready(timeout)
        # All prompts at once, as a server is used: batched steps instead of one prompt's.
        prompts = expected[server.name]["prompts"]
        with ThreadPoolExecutor(len(prompts)) as pool:
            return ready, list(pool.map(
                lambda p: server.greedy(p, expected["tokens"], timeout), prompts))

    problems = []
    batches = [names] if in_parallel else [[n] for n in names]
    for batch in batches:
        servers = [Served(n, models / n, logs, env) for n in batch]
        try:
            with ThreadPoolExecutor(len(servers)) as pool:
                results = list(pool.map(check, servers))
        finally:
            for server in servers:
                server.stop()
        for server, (ready, got) in zip(servers, results):
            found = mismatches(server.name, expected[server.name], got)
            problems += found
            verdict = (f"{len(found)} of {len(got)} prompts differ" if found else
                       f"{len(got)} prompts, {sum(map(len, got))} greedy tokens equal "
                       "transformers'")
            say(f"serve       {server.name}: ready in {ready:.0f} s; {verdict}")
    return problems


def compile_models(models: Path, topology: str, logs: Path, say) -> tuple[int, str]:
    """`tpu-models compile` of each shipped checkpoint for `topology`: (status, why)."""
    from tpu_models.topology.slices import UnknownTopology, topology as slice_of
    try:
        slice_ = slice_of(topology)
    except UnknownTopology as e:
        raise CannotRun(str(e)) from None
    # Tensor parallel over the slice's chips, up to the checkpoints' 4 attention heads.
    tp = min(slice_.chips, 4)
    worst = 0
    for name in ("qwen3-structural", "gemma3"):
        report = logs / f"compile-{name}.json"
        command = [sys.executable, "-m", "tpu_models.server.cli", "compile", str(models / name),
                   "--topology", slice_.name, "--tensor-parallel-size", str(tp), *ENGINE_ARGS,
                   "--json", str(report)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        (logs / f"compile-{name}.log").write_text(done.stdout + done.stderr)
        last = next((line for line in reversed((done.stdout + done.stderr).splitlines())
                     if line.startswith("compile: ")), f"exit status {done.returncode}")
        say(f"compile     {name} for {slice_.name} (TP {tp}): {last.removeprefix('compile: ')}")
        worst = max(worst, done.returncode if done.returncode in (0, 1) else 2)
    if worst == 0:
        return 0, f"ok, both architectures compile for {slice_.name} and fit"
    return worst, (f"a checkpoint {'does not compile' if worst == 1 else 'could not be compiled'}"
                   f" for {slice_.name}; logs: {logs}")


def run(args, say) -> tuple[int, str]:
    from tpu_models import host
    env = dict(os.environ)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    try:
        host.attention_mode(env)
    except host.AttentionModeError as e:
        raise CannotRun(str(e)) from None
    found = facts(env)
    say(f"platform    {found['platform']}"
        + (" (no TPU: tpu-models' compatibility layer)" if found["off_tpu"] else ""))
    say(f"devices     {len(found['devices'])}: {', '.join(found['devices'][:8])}")
    say(f"versions    {versions()}")
    say(f"attention   {found['attention']}"
        + ("" if os.environ.get(host.ATTENTION_ENV) else
           f" (the platform's; {host.ATTENTION_ENV} chooses another)"))
    features = found["features"]
    ok = [name for name, f in features.items() if not f["problems"]]
    say(f"adaptations {sum(len(f['patches']) for f in features.values())} patches for "
        f"{len(features)} features on this platform, written for tpu-inference "
        f"{found['written_for']} (this is {found['tpu_inference']}); ledger: docs/adaptations.md")
    for name in ok:
        say(f"  applies   {name}")
    for name, f in features.items():
        if f["problems"]:
            say(f"  REFUSED   {name}: {'; '.join(f['problems'])}")
    if args.topology:
        return compile_models(args.models, args.topology, args.keep_logs, say)
    problems = check_models(args.models, env, args.keep_logs, args.timeout,
                            in_parallel=found["off_tpu"], say=say)
    for line in problems:
        say(f"MISMATCH    {line}")
    if problems:
        return 1, (f"{len(problems)} mismatch(es) against transformers on {found['platform']} "
                   f"({found['attention']} attention); logs: {args.keep_logs}")
    return 0, (f"ok, both architectures serve transformers' greedy tokens on "
               f"{found['platform']} ({found['attention']} attention)")


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    if args.probe:
        print(json.dumps(probe()))
        return
    keep = args.keep_logs is not None
    args.keep_logs = args.keep_logs or Path(tempfile.mkdtemp(prefix="tpu-models-doctor-"))
    args.keep_logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        status, why = run(args, say=lambda line: print(line, flush=True))
    except CannotRun as e:
        status, why = 2, f"cannot run: {e}"
    except KeyboardInterrupt:
        status, why = 2, "interrupted"
    print(f"doctor: {why} ({time.monotonic() - started:.0f} s)", flush=True)
    if status == 0 and not keep:
        shutil.rmtree(args.keep_logs, ignore_errors=True)
    sys.exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
