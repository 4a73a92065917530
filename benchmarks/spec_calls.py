"""Compiled programs launched per EAGLE-3 decode step, fused (adapt.spec_fusion) or not.

    python -m tpu_models.benchmarks.spec_calls [--requests 4] [--out FILE]
    tpu-models bench spec-calls [...]

Three in-process engines (vllm.LLM, VLLM_ENABLE_V1_MULTIPROCESSING=0) of the
embedded demo model, each in its own process (the fusion is installed, or not,
when the engine's plugins load): plain, with its EAGLE-3 draft and
TPU_MODELS_SPEC_FUSION=0 (tpu-inference's calls), and with it fused. Each
generates the held-out demo requests once to compile, then again under
jax.profiler.trace, every engine step in a StepTraceAnnotation. Counted per
decode step (every request past its prompt: tpu-inference's "execute_model:
R reqs, T toks" annotation with T <= R * (1 + drafts)), medians over the
steps: executions of compiled programs (EXECUTE events, one per launch) and
PjitFunction(name) events (DISPATCH: a jitted function called from Python, two
per call in XLA:CPU's trace), the latter also by function; and the engine
step's time under the profiler (indicative only: tracing slows Python).
"""

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from tpu_models.server.serve import SPECULATIVE

DRAFTS = SPECULATIVE["eagle3"]["num_speculative_tokens"]
ENGINES = {"plain": {}, "eagle3 unfused": {"TPU_MODELS_SPEC_FUSION": "0"},
           "eagle3 fused": {"TPU_MODELS_SPEC_FUSION": "1"}}
# Trace event names (PJRT): a compiled program's execution on a device, and a jitted
# function's call from Python (named after it; XLA:CPU's trace holds two per call).
EXECUTE = re.compile(r"Executable::ExecuteHelper")
DISPATCH = re.compile(r"^PjitFunction\((.*)\)$")
STEP = re.compile(r"execute_model: (\d+) reqs, (\d+) toks")
OUT = Path(__file__).parent / "results" / "spec-calls.json"


def engine_run(name: str, requests: int, trace_dir: str) -> dict:
    """In this process: one engine, warmed up, then traced. Returns per-step counts."""
    import jax
    import vllm

    from tpu_models.benchmarks.demo_sets import held_out
    from tpu_models.server.serve import DEFAULT_MODEL

    speculative = None if name == "plain" else SPECULATIVE["eagle3"]
    llm = vllm.LLM(model=str(DEFAULT_MODEL), dtype="float32", max_model_len=256,
                   kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=256, max_num_seqs=64,
                   speculative_config=speculative)
    chats = [[{"role": "user", "content": e["request"]}] for e in held_out(requests)]
    params = vllm.SamplingParams(temperature=0, max_tokens=48)
    llm.chat(chats, params, use_tqdm=False)  # compiles the shapes the traced run meets

    core = llm.llm_engine.engine_core.engine_core  # vLLM's EngineCore, in this process
    step_fn, steps = core.step_fn, iter(range(1 << 30))

    def annotated_step():
        with jax.profiler.StepTraceAnnotation("engine_step", step_num=next(steps)):
            return step_fn()

    core.step_fn = annotated_step
    with jax.profiler.trace(trace_dir):
        texts = [o.outputs[0].text for o in llm.chat(chats, params, use_tqdm=False)]
    core.step_fn = step_fn
    from tpu_models.speculative.fusion import STEPS
    return {"texts": texts, "fusion": dict(STEPS), **count(trace_dir),
            "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
            "device": str(jax.devices()[0].platform)}


def count(trace_dir: str) -> dict:
    """Per engine step of the trace: executions and jit calls, decode steps only."""
    from jax.profiler import ProfileData

    path, = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    events = sorted((e.start_ns, e.start_ns + e.duration_ns, e.name)
                    for plane in ProfileData.from_file(path).planes
                    for line in plane.lines for e in line.events)
    steps = [(s, t) for s, t, name in events if name == "engine_step"]
    decode, names = [], Counter()
    for start, end in steps:
        inside = [n for s, t, n in events if start <= s and t <= end]
        shape = [m for n in inside if (m := STEP.match(n))]
        if not shape or any(int(m[2]) > int(m[1]) * (1 + DRAFTS) for m in shape):
            continue  # no model step, or a prompt being read
        calls = [m[1] for n in inside if (m := DISPATCH.match(n))]
        executions = sum(bool(EXECUTE.search(n)) for n in inside)
        decode.append({"executions": executions, "pjit_events": len(calls),
                       "step_ms": round((end - start) / 1e6, 2)})
        names.update(calls)
    median = {k: statistics.median(d[k] for d in decode) for k in decode[0]}
    return {"decode_steps": len(decode), "median": median,
            "pjit_events_per_step": {n: round(c / len(decode), 2) for n, c in names.most_common()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="spec_calls", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--engine", choices=sorted(ENGINES), help=argparse.SUPPRESS)  # a child
    args = p.parse_args(argv)
    if args.engine:
        with tempfile.TemporaryDirectory() as trace_dir:
            result = engine_run(args.engine, args.requests, trace_dir)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = {}
    for name, env in ENGINES.items():
        run = subprocess.run([sys.executable, "-m", "tpu_models.benchmarks.spec_calls",
                              "--engine", name, "--requests", str(args.requests)],
                             env={**os.environ, **child_env(), **env},
                             capture_output=True, text=True, timeout=1800)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{name}: no result\n{run.stderr[-4000:]}")
        results[name] = json.loads(line.removeprefix("RESULT "))
    plain = results["plain"]["texts"]
    print(f"{'engine':16} {'decode steps':>12} {'executions/step':>16} {'PjitFunction/step':>18} "
          f"{'step ms':>8} {'text = plain':>13}")
    for name, r in results.items():
        m = r["median"]
        print(f"{name:16} {r['decode_steps']:>12} {m['executions']:>16} {m['pjit_events']:>18} "
              f"{m['step_ms']:>8} {str(r['texts'] == plain):>13}")
    for name, r in results.items():
        print(f"\n{name}: PjitFunction(...) events per decode step (mean), by function")
        for fn, n in r["pjit_events_per_step"].items():
            print(f"  {n:5}  {fn}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"requests": args.requests, "max_tokens": 48,
                                    "num_speculative_tokens": DRAFTS, "engines": results},
                                   indent=1) + "\n")
    print(f"\nwritten to {args.out}")


def child_env() -> dict:
    from tpu_models import host
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "MODEL_IMPL_TYPE": "flax_nnx",
           "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "SKIP_JAX_PRECOMPILE": "1",
           **{k: v for k, v in os.environ.items() if k in ("JAX_PLATFORMS", )}}
    host.setup_host("auto", env)
    return env


if __name__ == "__main__":
    main()
