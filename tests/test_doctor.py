"""`tpu-models doctor`: the shipped references are transformers', and the command
serves both architectures against them, with its exit status saying how it went."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tpu_models import host
from tpu_models.server.doctor import MODELS, mismatches
from tests.conftest import tpu_compile_env
from tests.tiny import Reference


@pytest.mark.parametrize("name", ["qwen3-structural", "gemma3"])
def test_the_shipped_expectations_are_transformers_greedy_tokens_by_a_margin(name):
    expected = json.loads((MODELS / "expected.json").read_text())
    reference, want = Reference(MODELS / name), expected[name]
    for prompt, greedy in zip(want["prompts"], want["greedy"]):
        ids = list(prompt)
        for token in greedy:
            row = reference.logits(ids)[-1]
            second, first = np.sort(row)[-2:]
            assert first - second >= expected["min_margin"]  # not a near tie
            ids.append(int(row.argmax()))
        assert ids[len(prompt):] == greedy


def test_a_mismatch_names_the_model_the_prompt_and_the_first_token():
    want = {"prompts": [[5, 6, 7]], "greedy": [[1, 2, 3]], "margins": [0.4]}
    assert mismatches("gemma3", want, [[1, 2, 3]]) == []
    [line] = mismatches("gemma3", want, [[1, 9, 3]])
    assert "gemma3: prompt 0 (3 tokens)" in line and "at token 1" in line


def doctor(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "tpu_models.server.cli", "doctor", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


@pytest.mark.e2e
def test_doctor_passes_on_the_pallas_kernel(tmp_path):
    """The shipped checkpoints served through tpu-inference's RPA v3 Pallas kernel in
    JAX's TPU interpreter (TPU_MODELS_ATTENTION=rpa-interpret): exit 0, every check
    named."""
    good = doctor(env={**os.environ, host.ATTENTION_ENV: "rpa-interpret"})
    out = good.communicate(timeout=600)[0]
    print(out)
    assert good.returncode == 0, out
    for line in ("platform    cpu (no TPU", "versions    vllm-tpu 0.32.0, tpu-inference 0.32.0",
                 "attention   rpa-interpret",
                 "applies   the Pallas kernel interpreted off-TPU",
                 "applies   the hybrid KV cache for sliding-window layers",
                 "qwen3-structural: ready in", "gemma3: ready in"):
        assert line in out
    assert out.count("4 prompts, 32 greedy tokens equal transformers'") == 2
    assert out.strip().splitlines()[-1].startswith("doctor: ok, both architectures")


class _Shipped:
    """Stands in for a server of a shipped checkpoint: answers with the greedy tokens
    transformers gave (the shipped expectations), ready at once."""

    def __init__(self, name, directory, logs, env):
        self.name, self.want = name, json.loads((MODELS / "expected.json").read_text())[name]

    def wait_ready(self, timeout):
        return 0.0

    def greedy(self, prompt, tokens, timeout):
        return self.want["greedy"][self.want["prompts"].index(prompt)][:tokens]

    def stop(self):
        pass


def test_a_wrong_answer_exits_1_naming_the_model_prompt_and_token(tmp_path, monkeypatch, capsys):
    """The verdict on a mismatch, in-process (serving is the test above): a copy of the
    expectations with one Gemma 3 token changed, against servers answering the
    shipped ones."""
    from tpu_models.server import doctor as command
    wrong = tmp_path / "models"
    shutil.copytree(MODELS / "gemma3", wrong / "gemma3")
    expected = json.loads((MODELS / "expected.json").read_text())
    expected["gemma3"]["greedy"][2][3] = (expected["gemma3"]["greedy"][2][3] + 1) % 384
    (wrong / "expected.json").write_text(json.dumps(expected))
    monkeypatch.setattr(command, "Served", _Shipped)
    monkeypatch.setattr(command, "facts", lambda env: {
        "platform": "cpu", "off_tpu": True, "devices": ["cpu (cpu:0)"], "attention": "portable",
        "features": {}, "tpu_inference": "0.32.0", "written_for": "0.32.0"})
    with pytest.raises(SystemExit) as exit_:
        command.main(["--models", str(wrong), "--keep-logs", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert exit_.value.code == 1, out
    assert "MISMATCH    gemma3: prompt 2 (45 tokens) differs from transformers at token 3" in out
    assert "qwen3-structural" not in out  # only the checkpoints in --models are checked
    assert out.strip().splitlines()[-1].startswith("doctor: 1 mismatch(es)")


def test_doctor_cannot_run_with_an_unknown_attention_path():
    env = {**os.environ, host.ATTENTION_ENV: "pallas"}
    out, _ = doctor(env=env).communicate(timeout=120)
    lines = out.strip().splitlines()
    assert lines[-1].startswith("doctor: cannot run: TPU_MODELS_ATTENTION='pallas' is not")


@pytest.mark.e2e
def test_doctor_compiles_both_architectures_for_a_tpu_slice(tmp_path):
    """--topology: both shipped checkpoints compiled for a v6e-4 at TP 4 by the TPU
    compiler (tpu-models compile), on this CPU host; their reports kept."""
    out, _ = doctor("--topology", "v6e-4", "--keep-logs", str(tmp_path),
                    env=tpu_compile_env(dict(os.environ))).communicate(timeout=600)
    lines = out.strip().splitlines()
    assert lines[-1].startswith("doctor: ok, both architectures compile for v6e-4 and fit"), out
    for name in ("qwen3-structural", "gemma3"):
        assert any(line.startswith(f"compile     {name} for v6e-4 (TP 4): ") and
                   "programs compiled for v6e-4; fits" in line for line in lines), out
        report = json.loads((tmp_path / f"compile-{name}.json").read_text())
        assert report["fits"] and report["tensor_parallel_size"] == 4 and report["chips"] == 4
    out, _ = doctor("--topology", "v9z-1").communicate(timeout=120)
    assert out.strip().splitlines()[-1].startswith("doctor: cannot run: unknown TPU topology")
