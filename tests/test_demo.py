"""The embedded default answers in JSON: held-out requests through `tpu-models serve`."""

import pytest

from tpu_models.benchmarks.demo_sets import held_out
from tpu_models.benchmarks.demo_quality import evaluate
from tpu_models.server.serve import DEFAULT_NAME

pytestmark = pytest.mark.e2e
NUM = 48  # held-out requests per check


def test_free_decoding_answers_in_json(demo_server):
    result = evaluate(demo_server.url, DEFAULT_NAME, held_out(NUM), guided=False,
                      api_key=demo_server.api_key)
    # The targets (>= 90% / >= 80%); benchmarks/demo_quality.py measures more.
    assert result["valid_json"] >= 0.90, result["examples"]
    assert result["exact_values"] >= 0.80, result["examples"]


def test_free_decoding_copies_values_it_never_saw(demo_server):
    result = evaluate(demo_server.url, DEFAULT_NAME, held_out(NUM, novel=True), guided=False,
                      api_key=demo_server.api_key)
    assert result["valid_json"] >= 0.90, result["examples"]
    assert result["field_accuracy"] >= 0.90, result["examples"]


def test_guided_decoding_always_valid_under_concurrency(demo_server):
    # 16 at once: every request must be masked by its own schema's grammar.
    result = evaluate(demo_server.url, DEFAULT_NAME, held_out(NUM, novel=True), guided=True,
                      api_key=demo_server.api_key, concurrency=16)
    assert result["valid_json"] == 1.0, result["examples"]
    assert result["schema_valid"] == 1.0, result["examples"]
