"""What tests and benchmarks share (installed as `tpu_models.harness`; `tpu-models bench` uses it).

- `serve_process`: a `tpu-models serve` (or plain `vllm serve`) process on
  loopback, started and stopped as a service manager would, and the memory of
  its process tree;
- `stepper`: a model run step by step as tpu-inference's runner runs it, outside
  a server;
- `random_checkpoints`: real-shaped checkpoints with random weights, config-only
  directories, and HF tensors laid out as MaxText stores them;
- `storage_emulator`: Cloud Storage on loopback (fake-gcs-server).
"""
