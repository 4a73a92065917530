"""The same tokens on 1, 2 and 4 (fake CPU) devices, KV heads fewer than devices included.
Served at tensor parallel 2: tests/test_data_parallel.py (portable kernel),
tests/test_tpu_path.py (the RPA backend), tests/test_object_storage.py (from gs://)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tpu_models.harness import preloaded
from tests.conftest import fake_devices
from tests.tiny import make_gemma3, make_qwen3

FOUR_DEVICES = fake_devices(4)
MODELS = {
    # one KV head for 2 and 4 shards; a vocabulary no shard count divides
    "qwen3-structural": lambda d: make_qwen3(d, num_heads=4, num_kv_heads=1, vocab_size=383),
    "gemma3": lambda d: make_gemma3(d, num_heads=4, num_kv_heads=1, vocab_size=383),
}


def run_worker(args: list[str], log: Path) -> None:
    """tests/tp_worker.py in a process of its own (fake devices exist from JAX's start)."""
    worker = preloaded.python_module("tests.tp_worker", args, {**os.environ, **FOUR_DEVICES}, log,
                                     cwd=Path(__file__).parents[1])
    assert worker.wait(900) == 0, log.read_text()[-4000:]


@pytest.mark.slow  # a process of its own, three tensor-parallel sizes
@pytest.mark.parametrize("model", sorted(MODELS))
def test_greedy_tokens_equal_across_tensor_parallel_sizes(model, tmp_path):
    directory = MODELS[model](tmp_path / model)
    out = tmp_path / "tp.json"
    run_worker([str(directory), str(out)], tmp_path / "tp.log")
    results = json.loads(out.read_text())
    for tp in ("2", "4"):
        assert results[tp]["tokens"] == results["1"]["tokens"], f"TP={tp}"
        for name, logits in results[tp]["logits"].items():
            # fp32 logits, sharded vs one device: the split reductions (psum) change the order,
            # 1e-4 absolute on O(1) logits
            np.testing.assert_allclose(logits[:383], results["1"]["logits"][name][:383], atol=1e-4)
            # padding is never sampled: masked to float32's min (-3.4e38), far below any logit
            assert max(logits[383:], default=-np.inf) < -1e30
