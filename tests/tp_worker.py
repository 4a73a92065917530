"""Greedy tokens and logits of our models at several tensor-parallel sizes.

Runs in its own process: the fake CPU devices must exist before JAX starts.
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.tp_worker DIR ARCH OUT.json
"""

import json
import sys

import tests.conftest  # noqa: F401  (JAX on CPU, TPU identity)

import numpy as np

from tpu_models.stepper import Stepper


def greedy(stepper, prompts, steps):
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    chunk = {f"r{i}": p for i, p in enumerate(prompts)}
    first_logits = None
    for _ in range(steps):
        logits = stepper.step(chunk)
        if first_logits is None:
            first_logits = {k: v[-1].tolist() for k, v in logits.items()}
        chunk = {k: [int(v[-1].argmax())] for k, v in logits.items()}
        for k, t in chunk.items():
            tokens[k] += t
    return tokens, first_logits


def main(directory, out, sizes=(1, 2, 4)):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 380, n).tolist() for n in (3, 21, 70)]
    results = {}
    for tp in sizes:
        tokens, logits = greedy(Stepper(directory, num_devices=tp), prompts, steps=8)
        results[tp] = {"tokens": tokens, "logits": logits}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
