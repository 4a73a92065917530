"""Qwen3-structural (and plain Qwen3 checkpoints): the model (model.py) and the checkpoint entries (checkpoints.py)."""
