"""The TPU attention path (tpu-inference's RPA backend, its cache layout, its
shard_map over heads), run off-TPU with TPU_MODELS_ATTENTION=rpa-reference: the
kernel body is tpu-inference's own reference of RPA v3, everything around it is
what a TPU runs. Greedy tokens through the real `vllm serve` against transformers."""

import numpy as np
import pytest

from tpu_models import host
from tpu_models.harness.serve_process import Server, launched
from tpu_models.benchmarks.demo_sets import held_out
from tests.test_serve_e2e import complete_all
from tests.test_multi_lora import adapters_for, check_jobs, lora_modules, random_jobs
from tests.test_spec_decode import accepted_draft_tokens, chat_answers
from tests.test_tensor_parallel import FOUR_DEVICES
from tests.tiny import Reference, make_gemma3, make_qwen3

REFERENCE = {host.ATTENTION_ENV: "rpa-reference"}


def test_an_unknown_or_impossible_attention_path_is_refused_by_name(monkeypatch):
    cpu = {"JAX_PLATFORMS": "cpu"}
    interpret = {**cpu, host.ATTENTION_ENV: "rpa-interpret"}
    assert host.attention_mode(cpu) == "portable" and host.attention_mode({}) == "rpa"
    assert host.attention_mode({**cpu, **REFERENCE}) == "rpa-reference"
    assert host.attention_mode(interpret) == "rpa-interpret"
    for value, says in [("pallas", "is not an attention path: one of portable"),
                        ("rpa", "needs a TPU")]:
        with pytest.raises(host.AttentionModeError, match=says):
            host.attention_mode({**cpu, host.ATTENTION_ENV: value})
    # The interpreter's callbacks are private: another JAX is refused, not patched blind.
    monkeypatch.setattr(host, "_version", lambda package: "0.12.0")
    with pytest.raises(host.AttentionModeError, match="adapts JAX 0.11.2's Pallas TPU "
                                                      "interpreter, this is JAX 0.12.0"):
        host.attention_mode(interpret)


@pytest.mark.e2e
def test_both_architectures_through_the_rpa_backend_match_transformers(demo_server, tmp_path):
    """Qwen3-structural, beside three LoRA adapters in one mixed batch; Gemma 3 with sliding windows (the hybrid KV groups) and soft
    caps, tensor parallel 2 on fake devices (one KV head, repeated per shard); both
    with chunked prefill of prompts several windows long and a prefix shared by two
    of them (prefix caching). And the demo with its EAGLE-3 draft (attending through
    the same backend): the answers of plain decoding on the portable kernel."""
    qwen3 = make_qwen3(tmp_path / "qwen3")
    gemma3 = make_gemma3(tmp_path / "gemma3", sliding_window=16, attn_logit_softcapping=3.0,
                         final_logit_softcapping=20.0)
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 384, 70).tolist()
    prompts = [rng.integers(3, 384, n).tolist() for n in (1, 9, 40)] + \
        [shared + rng.integers(3, 384, 30).tolist(), shared + rng.integers(3, 384, 45).tolist()]
    common = ("--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "32",
              "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(32 << 20),
              "--served-model-name", "tiny")
    adapters = adapters_for(qwen3, tmp_path / "adapters")
    examples = held_out(8, novel=True)
    plain = chat_answers(demo_server, examples, [False] * len(examples))
    servers = {
        "qwen3": Server(qwen3, *common, "--enable-lora", "--max-loras", "3", "--max-lora-rank",
                        "8", *lora_modules(adapters), log=tmp_path / "qwen3.log", env=REFERENCE),
        "gemma3 tp2": Server(gemma3, *common, "--tensor-parallel-size", "2",
                             log=tmp_path / "gemma3.log", env={**REFERENCE, **FOUR_DEVICES}),
        "demo eagle3": Server(None, "--max-model-len", "256", "--kv-cache-memory-bytes",
                              str(64 << 20), "--speculative", "eagle3",
                              log=tmp_path / "demo.log", env=REFERENCE)}
    with launched(servers):
        for name, server in servers.items():
            server.start()
            assert "attention rpa-reference" in server.output(), name  # the ready line
            if name == "demo eagle3":
                assert chat_answers(server, examples, [False] * len(examples)) == plain
                assert accepted_draft_tokens(server) > 0
                continue
            if name == "qwen3":  # each request against its own adapter merged by peft
                references = {"tiny": Reference(qwen3)} | {
                    a: Reference(qwen3, adapter=path) for a, (_, path) in adapters.items()}
                check_jobs(server, random_jobs(["tiny", *adapters], 384, seed=3)[:8], references)
            got = complete_all(server, prompts, max_tokens=6)
            reference = Reference(qwen3 if name == "qwen3" else gemma3)
            for prompt, ids in zip(prompts, got):
                assert ids == reference.greedy(prompt, 6), f"{name}: prompt of {len(prompt)}"


@pytest.mark.e2e  # the real `tpu-models serve`, refusing at start-up
def test_tpu_models_serve_refuses_an_attention_path_it_cannot_run(tmp_path):
    server = Server(None, log=tmp_path / "serve.log", env={host.ATTENTION_ENV: "rpa"})
    assert server.wait_exit(60) != 0
    assert "TPU_MODELS_ATTENTION=rpa needs a TPU" in server.output()


@pytest.mark.e2e
def test_the_interpreted_kernel_serves_long_prompts_on_its_default_budget(tmp_path):
    """TPU_MODELS_ATTENTION=rpa-interpret with no --kv-cache-memory-bytes: JAX's
    interpreter copies the whole cache at every call, and the host's default share
    (4.8 GB here) met the OOM killer at the first prompts. Its own budget (two
    requests at --max-model-len) serves a 600-token prompt with transformers' tokens,
    the server's tree under 6 GB (2.9 GB measured)."""
    from tpu_models.harness.serve_process import TreeMemory
    from tpu_models.server.doctor import MODELS

    model = MODELS / "qwen3-structural"
    prompt = np.random.default_rng(7).integers(3, 384, 600).tolist()
    reference = Reference(model)
    want, ids = reference.greedy(prompt, 6), list(prompt)
    for token in want:  # no near tie for rounding to flip
        row = np.sort(reference.logits(ids)[-1])
        assert row[-1] - row[-2] > 1e-3
        ids.append(token)
    server = Server(model, "--served-model-name", "m", log=tmp_path / "serve.log",
                    env={host.ATTENTION_ENV: "rpa-interpret"})
    server.launch()
    memory = TreeMemory(server.process.pid)
    try:
        server.start()
        reply = server.client().completions.create(model="m", prompt=prompt, max_tokens=6,
                                                   temperature=0, extra_body={"return_token_ids": True})
        assert reply.choices[0].token_ids == want
        assert "KV cache budget" in server.tail(400) and "Pallas interpreter" in server.tail(400)
    finally:
        peak = memory.stop()
        server.stop()
    assert peak < 6e9, f"peak {peak / 1e9:.1f} GB"
