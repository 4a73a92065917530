"""Every test runs the real stack on this host's CPU, as `tpu-models serve` does."""

import os

# Before anything imports tpu_inference: JAX on CPU, and a TPU identity so that
# tpu-inference never asks the cloud metadata server who it is.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("MODEL_IMPL_TYPE", "flax_nnx")
for key, value in {"TPU_ACCELERATOR_TYPE": "v6e-1", "TPU_NAME": "local",
                   "TPU_WORKER_ID": "0"}.items():
    os.environ.setdefault(key, value)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
