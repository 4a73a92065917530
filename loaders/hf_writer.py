"""Writing HF checkpoints: sharded safetensors + index, all-or-nothing.

`HfWriter(out)` collects tensors into shards of at most `max_shard_bytes`
(a tensor larger than that gets a shard of its own), writes them into a
temporary directory beside `out`, and renames it to `out` only when
everything, index and side files included, is written. An interrupted or
failed export leaves no directory that looks complete.

safetensors writes a file from tensors held in memory, so a shard is queued
before it is written: memory stays bounded by the shard size plus the tensor
being added, whatever the model's size.
"""

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

from loaders.hf import CheckpointError

INDEX = "model.safetensors.index.json"


def _nbytes(tensor) -> int:
    return int(tensor.nbytes) if isinstance(tensor, np.ndarray) else tensor.numel() * tensor.element_size()


class HfWriter:

    def __init__(self, out: str | os.PathLike, *, max_shard_bytes: int = 2**30,
                 overwrite: bool = False, weights_name: str = "model"):
        self.out = Path(out).absolute()
        if self.out.exists() and not overwrite:
            raise CheckpointError(f"{self.out} already exists (pass --overwrite to replace it)")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.overwrite = overwrite
        self.max_shard_bytes = max_shard_bytes
        self.weights_name = weights_name  # "adapter_model" for PEFT adapters
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
        self._pending: dict[str, object] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0
        self.names: set[str] = set()

    def add(self, name: str, tensor) -> None:
        """Queues one tensor (numpy or torch); writes a shard when it is full."""
        if name in self.names:
            raise CheckpointError(f"tensor {name} written twice")
        size = _nbytes(tensor)
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.names.add(name)
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_bytes += size

    def add_all(self, tensors: Iterable[tuple[str, object]]) -> None:
        for name, tensor in tensors:
            self.add(name, tensor)

    def _flush(self) -> None:
        if not self._pending:
            return
        index = len(self._shards)
        path = self.tmp / f"shard-{index:05d}.safetensors"
        first = next(iter(self._pending.values()))
        tensors = {k: np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v.contiguous()
                   for k, v in self._pending.items()}
        save = save_numpy if isinstance(first, np.ndarray) else save_torch
        save(tensors, path, metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def write_json(self, name: str, content: dict) -> None:
        (self.tmp / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")

    def copy_file(self, source: str | os.PathLike, name: str | None = None) -> None:
        shutil.copyfile(source, self.tmp / (name or Path(source).name))

    def commit(self) -> Path:
        """Names the shards HF-style, writes the index, and renames into place."""
        self._flush()
        count = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = (f"{self.weights_name}.safetensors" if count == 1 else
                     f"{self.weights_name}-{i + 1:05d}-of-{count:05d}.safetensors")
            (self.tmp / f"shard-{i:05d}.safetensors").rename(self.tmp / final)
            weight_map.update({n: final for n in names})
        if count > 1:
            self.write_json(INDEX, {"metadata": {"total_size": self.total_bytes},
                                    "weight_map": dict(sorted(weight_map.items()))})
        if self.out.exists():  # only reachable with overwrite=True
            shutil.rmtree(self.out)
        self.tmp.rename(self.out)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "HfWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
