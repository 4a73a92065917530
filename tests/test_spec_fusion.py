"""EAGLE-3 steps verified and drafted in one compiled program (adapt.spec_fusion):
the text of plain decoding, from the fused program, not tpu-inference's calls."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_spec_decode import chat_answers
from tpu_models.benchmarks.demo_data import held_out

pytestmark = pytest.mark.e2e

REQUESTS = 4
# An in-process engine (its runner in this script's process, so its counters too).
SCRIPT = """
import json, sys, vllm
from tpu_models.adapt import spec_fusion
from tpu_models.server.serve import DEFAULT_MODEL, SPECULATIVE
llm = vllm.LLM(model=str(DEFAULT_MODEL), dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=64 << 20, max_num_seqs=64, max_num_batched_tokens=256,
               speculative_config=SPECULATIVE["eagle3"])
chats = [[{"role": "user", "content": r}] for r in json.loads(sys.argv[1])]
out = llm.chat(chats, vllm.SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
print("RESULT " + json.dumps({"texts": [o.outputs[0].text for o in out],
                              "steps": dict(spec_fusion.STEPS)}))
"""


def test_fused_eagle3_steps_give_the_text_of_plain_decoding(demo_server):
    examples = held_out(REQUESTS, novel=True)
    plain = chat_answers(demo_server, examples, [False] * REQUESTS)
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps([e["request"] for e in examples])],
        cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["texts"] == plain
    steps = result["steps"]
    # Every step of an EAGLE-3 engine is eligible here: all fused, our draft inputs
    # upstream's (none redrafted), none failed.
    assert steps.get("fused", 0) > 4 and set(steps) == {"fused"}, steps


def test_the_draft_passes_cover_every_request_with_few_programs():
    """The draft's later passes run on `_live_rows` rows: every request of the step
    has its row, and each token bucket (the engine pads tokens to powers of two)
    needs few programs: a decode step (1 + 3 drafts a request) one, steps with a
    prompt chunk mostly one more, whatever their number of requests."""
    from tpu_models.adapt.spec_fusion import _live_rows

    for tokens in (1 << b for b in range(2, 9)):
        for requests in range(1, tokens + 1):
            rows = _live_rows(requests, tokens)
            assert requests <= rows <= max(tokens, 1 << (requests - 1).bit_length())
            assert rows & (rows - 1) == 0  # a power of two
        assert _live_rows(tokens // 4, tokens) == tokens // 4  # a decode step
        # 1 to tokens / 4 requests (a chunk and decodes): two programs
        assert {_live_rows(r, tokens) for r in range(1, tokens // 4 + 1)} == (
            {tokens // 8, tokens // 4} if tokens >= 8 else {1})


# The same engine, the draft's first pass finished on the last rows (ours) or on every
# row (tpu-inference's, with ours switched off): each step's drafts for its requests.
FIRST_PASS = """
import json, sys
import numpy as np
import vllm
from tpu_models.adapt import spec_fusion, speculative
from tpu_models.server.serve import DEFAULT_MODEL, SPECULATIVE
ours = sys.argv[2] == "ours"
if not ours:
    speculative._first_pass_on_rows_applies = lambda *a: False
passes, drafts, fused = [], [], spec_fusion._compiled()
first_pass = speculative._first_pass_on_rows
speculative._first_pass_on_rows = lambda *a: passes.append(1) or first_pass(*a)

def capture(*args):
    out = fused(*args)
    requests = int(np.asarray(args[9][2]).reshape(-1)[0])  # the draft inputs' num_reqs
    drafts.append(np.asarray(out["drafts"])[:requests].tolist())
    return out

spec_fusion._compiled = lambda: capture
llm = vllm.LLM(model=str(DEFAULT_MODEL), dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=64 << 20, max_num_seqs=64, max_num_batched_tokens=256,
               speculative_config=SPECULATIVE["eagle3"])
chats = [[{"role": "user", "content": r}] for r in json.loads(sys.argv[1])]
params = vllm.SamplingParams(temperature=0, max_tokens=64)
texts = [llm.chat([c], params, use_tqdm=False)[0].outputs[0].text for c in chats]
texts += [o.outputs[0].text for o in llm.chat(chats, params, use_tqdm=False)]
print("RESULT " + json.dumps({"texts": texts, "drafts": drafts, "passes": len(passes)}))
"""


def test_the_drafts_first_pass_on_last_rows_drafts_what_the_full_pass_drafts():
    """adapt.speculative._first_pass_on_rows writes every token's keys and values into
    the draft's cache but finishes the layer on each request's last row only: each
    step's drafts must be those of tpu-inference's pass over every row, for prompts
    one at a time and together, and for decode steps with rejected drafts."""
    from tpu_models.benchmarks.demo_data import free_held_out

    requests = json.dumps([e["request"] for e in free_held_out()[:6]])
    runs = {}
    for which in ("ours", "upstream"):
        run = subprocess.run(
            [sys.executable, "-c", FIRST_PASS, requests, which], cwd=Path(__file__).parents[1],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        assert run.returncode == 0, run.stderr[-3000:]
        line = next(ln for ln in run.stdout.splitlines() if ln.startswith("RESULT "))
        runs[which] = json.loads(line.removeprefix("RESULT "))
    ours, upstream = runs["ours"], runs["upstream"]
    # Ours traced (once per program), upstream's never; as many fused steps in each.
    assert ours["passes"] > 0 and upstream["passes"] == 0
    assert len(ours["drafts"]) == len(upstream["drafts"]) > 20
    assert ours["drafts"] == upstream["drafts"]
    assert ours["texts"] == upstream["texts"]
