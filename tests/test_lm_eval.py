"""lm-eval (0.4.13) as the client of `tpu-models serve`: multiple choice by log-likelihood
through `local-completions` (echo + logprobs) and greedy generation through
`local-chat-completions`, each against lm-eval's own `hf` model on the same tiny Gemma 3
(fp32; conftest's shared gemma3_server). The tasks and their data are in
tests/lm_eval_tasks/."""

import contextlib
import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

# lm-eval reads its task data with `datasets`, which must not look for a hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
NAME = "tiny"


def evaluate(model: str, model_args: dict, task: str, **kwargs) -> tuple[dict, list[dict]]:
    """lm-eval's Python API on one task of ours: (its results, its samples by doc_id)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(TASKS), include_defaults=False)
    with contextlib.chdir(ROOT):  # the tasks name their data files from the repository root
        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task],
                                      task_manager=tasks, log_samples=True, **kwargs)
    return out["results"][task], sorted(out["samples"][task], key=lambda s: s["doc_id"])


def reference(gemma3, task: str, **kwargs):
    """lm-eval's `hf` model on one torch thread: a tiny model gains nothing from two, and
    two threads waiting on each other slow it tenfold on a busy 2-core host."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return evaluate("hf", {"pretrained": str(gemma3), "dtype": "float32", "device": "cpu"},
                        task, **kwargs)
    finally:
        torch.set_num_threads(threads)


def test_multiple_choice_loglikelihoods_match_lm_evals_hf_model(gemma3_server, gemma3_ascii):
    server, gemma3 = gemma3_server, gemma3_ascii
    served, served_samples = evaluate("local-completions", {
        "base_url": f"{server.url}/v1/completions", "model": NAME, "tokenizer": str(gemma3),
        "tokenizer_backend": "huggingface", "max_length": 512, "batch_size": 16,
        "num_concurrent": 2, "max_retries": 1}, "tiny_capitals")
    hf, hf_samples = reference(gemma3, "tiny_capitals", batch_size=32)

    assert len(served_samples) == len(hf_samples) == 32
    # Each sample: (log-likelihood, is_greedy) of its four choices.
    got = np.array([[ll for ll, _ in s["filtered_resps"]] for s in served_samples])
    want = np.array([[ll for ll, _ in s["filtered_resps"]] for s in hf_samples])
    assert got.shape == want.shape == (32, 4)
    assert want.std() > 1, want  # distinct values, not a constant both sides agree on
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
    assert [[g for _, g in s["filtered_resps"]] for s in served_samples] == \
           [[g for _, g in s["filtered_resps"]] for s in hf_samples]
    for metric in ("acc,none", "acc_norm,none"):
        assert served[metric] == hf[metric], (metric, served, hf)
    assert 0 < hf["acc,none"] < 1, hf  # an untrained model is at chance, 1 in 4
    print(f"max |log-likelihood served - hf| = {np.abs(got - want).max():.2e}; "
          f"acc {served['acc,none']}, acc_norm {served['acc_norm,none']}")


def test_chat_generation_matches_lm_evals_hf_model(gemma3_server, gemma3_ascii):
    server, gemma3 = gemma3_server, gemma3_ascii
    served, served_samples = evaluate("local-chat-completions", {
        "base_url": f"{server.url}/v1/chat/completions", "model": NAME, "num_concurrent": 4,
        "max_retries": 1}, "tiny_sums", apply_chat_template=True)
    hf, hf_samples = reference(gemma3, "tiny_sums", apply_chat_template=True, batch_size=8)

    assert len(served_samples) == len(hf_samples) == 24
    replies = [s["resps"][0][0] for s in served_samples]
    assert replies == [s["resps"][0][0] for s in hf_samples]
    assert all(replies) and len(set(replies)) > 4, replies  # replies follow the prompt
    assert [s["filtered_resps"] for s in served_samples] == [s["filtered_resps"] for s in hf_samples]
    assert served["exact_match,first-digit"] == hf["exact_match,first-digit"], (served, hf)
    print(f"{len(set(replies))} distinct replies; exact_match {served['exact_match,first-digit']}")
