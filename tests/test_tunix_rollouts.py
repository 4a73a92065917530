"""Our Gemma 3 as Tunix's vLLM rollout engine (google-tunix 0.1.5, tpu_models.tunix).

Tunix's own VllmRollout (in-process vLLM, dummy weights, then the trainer's state
synced in memory) against Tunix's own VanillaRollout sampler on the same trainer
model: a Gemma 3 of two KV heads whose window (8) is shorter than the prompts (up to
40 tokens), five local layers and a global one (the hybrid KV cache), prompts
sharing a prefix (prefix caching), in float32. Each configuration runs in its own
process (tests/tunix_rollouts_run.py; TP 2 on fake devices), two at a time.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpu_models.harness import preloaded

pytestmark = pytest.mark.e2e  # vLLM engines, in processes of their own

ROOT = Path(__file__).parents[1]
# Started in this order, two at a time: the longest first (186, 171, 112 and 81 s in
# a full run of the suite).
RUNS = {"tp2 lora merged": ("tests.tunix_rollouts_run", "--tp", "2", "--lora", "merged"),
        "grpo": ("tests.tunix_grpo_run", ),
        "tp1 lora slots": ("tests.tunix_rollouts_run", "--lora", "slots"),
        "tp1": ("tests.tunix_rollouts_run", )}
# Both sides compute in float32 from the same weights; the engine's ops (paged
# attention, fused projections) sum in other orders: log-probabilities agree to
# a few float32 ulps of values near 5 (1.4e-6 seen). Greedy tokens are compared
# where the reference's top two logits are further apart than that.
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """Two processes at a time (each holds an engine; the suite's other worker has its
    own), the longest first: the next starts as soon as one ends."""
    def start(name):
        module, *options = RUNS[name]
        out = tmp_path_factory.mktemp(name.replace(" ", "-"))
        return preloaded.python_module(module, [str(out), *options], cwd=ROOT, log=out / "run.log",
                                       env={**os.environ, "SKIP_JAX_PRECOMPILE": "1"}), out

    found, waiting, running = {}, list(RUNS), {}
    while waiting or running:
        while waiting and len(running) < 2:
            name = waiting.pop(0)
            running[name] = (*start(name), time.monotonic() + 600)
        done = next((n for n, (proc, _, deadline) in running.items()
                     if proc.poll() is not None or time.monotonic() > deadline), None)
        if done is None:
            time.sleep(0.5)
            continue
        proc, out, _ = running.pop(done)
        text = (out / "run.log").read_text()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            pytest.fail(f"{done}: still running after 600 s:\n{text[-4000:]}")
        line = next((ln for ln in text.splitlines() if ln.startswith("REPORT ")), None)
        assert proc.returncode == 0 and line, f"{done}:\n{text[-4000:]}"
        found[done] = json.loads(line.removeprefix("REPORT ")) | {"out": str(out)}
    return found


def check_rounds(report: dict) -> None:
    assert [r["label"] for r in report["rounds"]] == ["load", "after sync 1", "after sync 2"]
    for round_ in report["rounds"]:
        for i, row in enumerate(round_["rows"]):
            where = f"{round_['label']}, prompt {i}"
            assert min(row["margins"]) > 10 * LOGPROB_ATOL, where  # the data is decisive
            assert row["vllm"] == row["tunix"], where
            assert len(row["vllm_logprobs"]) == len(row["tunix_logprobs"]), where
            assert max(abs(a - b) for a, b in zip(row["vllm_logprobs"], row["tunix_logprobs"])) \
                < LOGPROB_ATOL, where


def test_rollouts_equal_tunix_sampler_at_load_and_after_each_sync(reports):
    """Full weights: at load and after two 'optimizer steps' (all weights moved), at TP 1;
    the prompts repeated each round, so stale prefix KV would show."""
    report = reports["tp1"]
    check_rounds(report)
    assert report["kv_cache_groups"] == 6  # sliding-window layers in groups of their own
    # vLLM's default, where Tunix's RolloutConfig says False: these rollouts ran with it.
    assert report["async_scheduling"] is True
    # The sampler asks for logprobs=1 (compared with Tunix's above): a top 1 a step.
    assert report["max_logprobs"] == 1


def test_lora_rollouts_equal_tunix_sampler_merged_and_in_slots(reports):
    """qwix LoRA (rank 4, alpha 8) trained, base frozen: each sync moves the LoRA
    parameters alone (as Tunix's RLCluster.sync_weights does), into our LoRA slots at
    TP 1, merged into the weights at TP 2 (fake devices)."""
    for name in ("tp1 lora slots", "tp2 lora merged"):
        check_rounds(reports[name])
    assert reports["tp2 lora merged"]["mesh"] == {"data": 1, "model": 2}
    # The same trainer, the same rollouts, either way.
    slots, merged = (reports[n]["rounds"] for n in ("tp1 lora slots", "tp2 lora merged"))
    assert [[r["vllm"] for r in x["rows"]] for x in slots] == \
        [[r["vllm"] for r in x["rows"]] for x in merged]


def test_seeded_rollouts_repeat_and_rows_differ(reports):
    """RolloutConfig.seed reaches vLLM (request i: seed + i): the same call twice gives the
    same tokens, and two rows of one prompt differ (temperature 1)."""
    for name in ("tp1", "tp1 lora slots", "tp2 lora merged"):
        first, second = reports[name]["seeded"]
        assert first == second
        assert first[0] != first[1]


def test_a_wrong_or_partial_sync_is_refused_by_name(reports):
    refused = reports["tp1"]["refused"]
    assert refused == [
        "a leaf missing: engine weights with no trainer leaf: model.layers.2.mlp.up_proj.weight "
        "(from layers/2/mlp/up_proj/kernel) (1)",
        "LoRA parameters alone: the first sync must hold the trainer's full weights (nnx.Param), "
        "not its LoRA parameters alone",
        "a leaf with no engine weight: trainer leaves with no engine weight: "
        "layers/0/attn/gate/scale (1)",
        refused[3]]
    assert refused[3].startswith(
        "another shape: trainer leaf layers/0/mlp/down_proj/kernel [96, 64] gives "
        "model.layers.0.mlp.down_proj.weight [64, 96]; the engine's config.json implies [64, 128]")


def without_padding(rows: list[list[int]], pad: int) -> list[list[int]]:
    return [[t for t in row if t != pad] for row in rows]


def test_grpo_with_vllm_rollouts_then_exported_and_served(reports, tmp_path):
    """Tunix's GRPO learner, rollout_engine="vllm", LoRA rank 4, three steps on CPU, a
    verifiable reward (Tunix's <reasoning>/<answer> format). At each step's rollout
    both engines roll out greedily on that step's weights: equal. Then its LoRA
    checkpoint, exported with `tpu-models export tunix` onto its base (exported from
    the base Tunix saved), served with --reasoning-parser tunix: Tunix's sampler's
    greedy tokens on the final weights."""
    from tpu_models.harness.serve_process import Server

    report, out = reports["grpo"], Path(reports["grpo"]["out"])
    assert report["steps"] == 3 and len(report["checks"]) == 3
    for step, check in enumerate(report["checks"]):
        assert without_padding(check["vllm"], check["pad"]) == \
            without_padding(check["tunix"], check["pad"]), f"step {step}"
    assert len(report["rewards_seen"]) == 3 * 4  # two prompts, two generations each
    def export(*argv):
        run = subprocess.run([sys.executable, "-m", "tpu_models.server.cli", "export", "tunix",
                              *map(str, argv)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
    export(out / "base-ckpt", "--base", out / "model", "--out", tmp_path / "base")
    export(out / "ckpt", "--base", tmp_path / "base", "--lora-alpha", 8, "--out", tmp_path / "final")
    final = report["final"]
    with Server(tmp_path / "final", "--served-model-name", "m", "--reasoning-parser", "tunix",
                "--max-model-len", "128", "--kv-cache-memory-bytes", str(16 << 20),
                log=tmp_path / "serve.log") as server:
        for prompt, want in zip(final["prompts"], without_padding(final["tokens"], final["pad"])):
            reply = server.client().completions.create(
                model="m", prompt=prompt, max_tokens=8, temperature=0,
                extra_body={"return_token_ids": True})
            assert [t for t in reply.choices[0].token_ids if t != final["pad"]] == want, prompt
