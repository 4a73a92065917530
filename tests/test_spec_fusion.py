"""EAGLE-3 steps verified and drafted in one compiled program (speculative.fusion):
the text of plain decoding, from the fused program, not tpu-inference's calls; a
lone request's programs compiled before the engine is ready (speculative.warm_up)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tpu_models.harness import preloaded
from tests.test_spec_decode import chat_answers
from tpu_models.benchmarks.demo_sets import held_out

pytestmark = pytest.mark.e2e

REQUESTS = 4
# One in-process EAGLE-3 engine (its runner in this script's process, so its counters
# too) for both checks below, as a server starts (every bucket precompiled, the
# warm-up served). Its draft's first pass also runs tpu-inference's own pass over
# every row, in the same program, on the same inputs: per program run, the largest
# gaps between the two (the rows of the step's requests; the draft's cache). What the
# engine returns is ours alone: upstream's pass only feeds the gaps.
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
import vllm
from tpu_models.speculative import draft
from tpu_models.speculative.fusion import STEPS
from tpu_models.server.serve import DEFAULT_MODEL, SPECULATIVE
ours, gaps = draft.first_pass_on_rows, []

def both(proposer, state_leaves, kv_caches, input_ids, hidden, md, rows):
    caches, out, residual = ours(proposer, state_leaves, kv_caches, input_ids, hidden, md, rows)
    layers = tuple(proposer.runner.layer_name_to_kvcache_index.items())
    full_caches, full_out, full_residual, _ = proposer.model_fn(
        state_leaves, list(kv_caches), input_ids, hidden, md, layers, spec_step_idx=0)
    mine = jnp.arange(rows.shape[0]) < md.request_distribution[2]  # the step's requests
    def gap(a, b):  # (largest difference, largest magnitude of upstream's)
        a, b = jnp.where(mine[:, None], a, 0), jnp.where(mine[:, None], b[rows], 0)
        return jnp.abs(a - b).max(), jnp.abs(b).max()
    jax.debug.callback(lambda *g: gaps.append([float(x) for x in g]),
                       *gap(out, full_out), *gap(residual, full_residual[0]),
                       jnp.abs(caches[-1] - full_caches[-1]).max(), jnp.abs(full_caches[-1]).max())
    return caches, out, residual

draft.first_pass_on_rows = both
llm = vllm.LLM(model=str(DEFAULT_MODEL), dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=64 << 20, max_num_seqs=64, max_num_batched_tokens=256,
               speculative_config=SPECULATIVE["eagle3"])
compiled = []  # what XLA compiles from now on (a persistent cache's hit included)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _, fun_name="", **__: compiled.append(fun_name)
    if event == "/jax/core/compile/backend_compile_duration" else None)
for n, temperature in ((5, 0.0), (40, 1.0), (150, 0.0), (200, 1.0)):  # lone requests
    llm.generate({"prompt_token_ids": list(range(3, 3 + n))}, use_tqdm=False,
                 sampling_params=vllm.SamplingParams(temperature=temperature, max_tokens=7,
                                                     ignore_eos=True))
lone = [name for name in compiled if "verify_and_draft" in name]
greedy = vllm.SamplingParams(temperature=0, max_tokens=64)
requests = json.loads(sys.argv[1])
chats = [[{"role": "user", "content": r}] for r in requests["plain"]]
out = llm.chat(chats, greedy, use_tqdm=False)
free = [[{"role": "user", "content": r}] for r in requests["free"]]
for c in free:  # one at a time, then together (a chunked prefill)
    llm.chat([c], greedy, use_tqdm=False)
llm.chat(free, greedy, use_tqdm=False)
print("RESULT " + json.dumps({"texts": [o.outputs[0].text for o in out],
                              "steps": dict(STEPS), "compiled_by_lone_requests": lone,
                              "gaps": gaps}))
"""


def result_of(script: str, requests: str, log: Path):
    """SCRIPT's RESULT line: the script run as `python -c SCRIPT REQUESTS` with its
    engine in its own process (forked from the interpreter that imported vLLM),
    compiling at its start what a server's does (the suite's servers skip that)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "SKIP_JAX_PRECOMPILE": "0"}
    done = preloaded.python_code(script, [requests], log=log, cwd=Path(__file__).parents[1],
                                 env=env)
    status, output = done.wait(900), log.read_text()
    assert status == 0, output[-3000:]
    line = next(ln for ln in output.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tpu_models.benchmarks.demo_sets import free_held_out

    examples = held_out(REQUESTS, novel=True)
    requests = {"plain": [e["request"] for e in examples],
                "free": [e["request"] for e in free_held_out()[:6]]}
    result = result_of(SCRIPT, json.dumps(requests),
                       tmp_path_factory.mktemp("eagle3-engine") / "engine.log")
    return examples, result


def test_fused_eagle3_steps_give_the_text_of_plain_decoding(engine, demo_server):
    examples, result = engine
    assert result["texts"] == chat_answers(demo_server, examples, [False] * REQUESTS)
    steps = result["steps"]
    # Every step of an EAGLE-3 engine is eligible here: all fused, our draft inputs
    # upstream's (none redrafted), none failed.
    assert steps.get("fused", 0) > 4 and set(steps) == {"fused"}, steps
    # A lone request, greedy or sampled, of any prompt length up to the context, runs
    # programs the engine compiled before it was ready (speculative.warm_up).
    assert result["compiled_by_lone_requests"] == []


def test_the_draft_passes_cover_every_request_with_few_programs():
    """The draft's later passes run on `live_rows` rows: every request of the step
    has its row, and each token bucket (the engine pads tokens to powers of two)
    needs few programs: a decode step (1 + 3 drafts a request) one, steps with a
    prompt chunk mostly one more, whatever their number of requests."""
    from tpu_models.speculative.fusion import live_rows

    for tokens in (1 << b for b in range(2, 9)):
        for requests in range(1, tokens + 1):
            rows = live_rows(requests, tokens)
            assert requests <= rows <= max(tokens, 1 << (requests - 1).bit_length())
            assert rows & (rows - 1) == 0  # a power of two
        assert live_rows(tokens // 4, tokens) == tokens // 4  # a decode step
        # 1 to tokens / 4 requests (a chunk and decodes): two programs
        assert {live_rows(r, tokens) for r in range(1, tokens // 4 + 1)} == (
            {tokens // 8, tokens // 4} if tokens >= 8 else {1})


def test_the_drafts_first_pass_on_last_rows_is_the_full_pass_at_those_rows(engine):
    """speculative.draft.first_pass_on_rows writes every token's keys and values into
    the draft's cache but finishes the layer on each request's last row only. Against
    tpu-inference's pass over every row, run beside it on the same inputs at every
    step (lone requests greedy and sampled; prompts one at a time and six together, a
    chunked prefill; decode steps with rejected drafts): the same cache and, at those
    rows, the same outputs. Tolerance: the two compute the rows' dots and attention in
    other orders (other row counts, the decode path's key blocks); fp32 dots of length
    K <= 768 (the MLP's) differ by at most K * eps relative to the magnitudes they sum,
    about 1e-4."""
    gaps = engine[1]["gaps"]
    assert len(gaps) > 20  # every speculative step drafts
    bound = 768 * np.finfo(np.float32).eps
    for out, out_scale, residual, residual_scale, cache, cache_scale in gaps:
        assert out_scale > 0 and residual_scale > 0 and cache_scale > 0
        assert out <= bound * out_scale and residual <= bound * residual_scale
        assert cache <= bound * cache_scale
