"""Greedy tokens and logits of our models at several tensor-parallel sizes.

Runs in its own process: the fake CPU devices must exist before JAX starts.
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.tp_worker DIR OUT.json [ADAPTER...]

With adapters: one prefill step, request r{i} on adapter i (in slots,
--enable-lora) and "base" on none; its last logits and the slot buffers'
shardings per size.
"""

import json
import sys

import tests.conftest  # noqa: F401  (JAX on CPU, TPU identity)

import numpy as np

from tpu_models.harness.stepper import Stepper


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


def with_adapters(directory, out, adapters, sizes=(1, 2, 4)):
    from vllm.lora.request import LoRARequest

    rng = np.random.default_rng(0)
    names = [f"r{i}" for i in range(len(adapters))] + ["base"]
    prompts = {name: rng.integers(0, 380, n).tolist() for name, n in zip(names, (9, 33, 4, 20))}
    requests = {f"r{i}": LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)}
    results = {"prompts": prompts}
    for tp in sizes:
        stepper = Stepper(directory, num_devices=tp, enable_lora=True, max_loras=len(adapters),
                          max_lora_rank=8)
        logits = stepper.step(prompts, requests)
        slots = stepper.lora
        results[tp] = {
            "logits": {k: v[-1].tolist() for k, v in logits.items()},
            "shardings": {f"{part}:{prefix.rsplit('.', 1)[-1]}": spec(buffers[prefix])
                          for part, buffers in (("a", slots.a), ("b", slots.b))
                          for prefix in buffers if ".layers.0." in prefix},
            "base_shardings": dict(base_specs(stepper)),
        }
    with open(out, "w") as f:
        json.dump(results, f)


def base_specs(stepper):
    from flax import nnx
    from tpu_inference.layers.jax.linear import JaxEinsum
    for _, node in nnx.iter_graph(stepper.interface.model):
        if isinstance(node, JaxEinsum) and ".layers.0." in node.prefix:
            yield node.prefix.rsplit(".", 1)[-1], spec(node.weight.value)


def spec(array) -> list:
    """The mesh axis of each dim (None: whole on every device)."""
    axes = list(getattr(array.sharding, "spec", ()))
    return axes + [None] * (array.ndim - len(axes))


if __name__ == "__main__":
    if len(sys.argv) > 3:
        with_adapters(sys.argv[1], sys.argv[2], sys.argv[3:])
    else:
        main(sys.argv[1], sys.argv[2])
