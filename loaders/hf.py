"""Reading HF checkpoints: safetensors only, single file or sharded.

`HfCheckpoint(dir)` lists every tensor (name, shape, dtype, file) from the
safetensors headers alone, so a checkpoint can be checked against its name/shape
table (see `tables.py`) before a single weight is read. Pickle formats (.bin,
.pt) are refused: loading them can run arbitrary code.
"""

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from safetensors import SafetensorError, safe_open

INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: F32, BF16, F16, F8_E4M3, I8, ...
    file: Path


class HfCheckpoint:
    """The safetensors files of an HF checkpoint directory and the tensors in them."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        self.files = self._files()
        self.tensors: dict[str, TensorInfo] = {}
        for file in self.files:
            for info in _read_header(file):
                if info.name in self.tensors:
                    raise CheckpointError(
                        f"{info.name}: stored twice, in {self.tensors[info.name].file.name} "
                        f"and {file.name}")
                self.tensors[info.name] = info
        self._check_index()

    def _files(self) -> list[Path]:
        index = self.directory / INDEX
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            files = sorted({self.directory / f for f in weight_map.values()})
            for f in files:
                if Path(f).resolve().parent != self.directory.resolve():
                    raise CheckpointError(f"{index}: {f.name} lies outside {self.directory}")
                if not f.exists():
                    raise CheckpointError(f"{index}: names {f.name}, which does not exist")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if files:
            return files
        pickles = sorted(p.name for p in self.directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{self.directory}: only pickle weights ({', '.join(pickles)}); tpu-models loads "
                "safetensors only, since unpickling can run arbitrary code. Convert them "
                "(e.g. transformers' save_pretrained(..., safe_serialization=True)).")
        raise CheckpointError(f"{self.directory}: no *.safetensors files")

    def _check_index(self) -> None:
        index = self.directory / INDEX
        if not index.exists():
            return
        for name, file in _read_json(index)["weight_map"].items():
            info = self.tensors.get(name)
            if info is None:
                raise CheckpointError(f"{index}: lists {name} in {file}, which lacks it")
            if info.file.name != file:
                raise CheckpointError(f"{index}: lists {name} in {file}, but it is in {info.file.name}")

    def check(self, expected: Mapping[str, tuple[int, ...]], *, optional: Iterable[str] = ()) -> None:
        """Raises CheckpointError unless the tensors are exactly `expected` (plus `optional`)."""
        check_tensors({n: (i.shape, i.file.name) for n, i in self.tensors.items()},
                      expected, optional=optional, where=str(self.directory))

    def iter_tensors(self, framework: str = "pt") -> Iterator[tuple[str, object]]:
        """Yields (name, tensor) file by file, holding one tensor at a time."""
        for file in self.files:
            with _open(file, framework) as f:
                for name in f.keys():
                    try:
                        yield name, f.get_tensor(name)
                    except SafetensorError as e:
                        raise CheckpointError(f"{file}: tensor {name} cannot be read: {e}") from e

    def read(self, name: str, framework: str = "pt"):
        info = self.tensors[name]
        with _open(info.file, framework) as f:
            return f.get_tensor(name)


def check_tensors(found: Mapping[str, tuple[tuple[int, ...], str]],
                  expected: Mapping[str, tuple[int, ...]], *, optional: Iterable[str] = (),
                  where: str = "checkpoint") -> None:
    """found: name -> (shape, file). Lists every missing, unexpected and misshapen tensor."""
    optional = set(optional)
    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
        elif tuple(found[name][0]) != tuple(shape):
            problems.append(f"tensor {name} in {found[name][1]} has shape {list(found[name][0])}, "
                            f"expected {list(shape)}")
    for name in sorted(set(found) - set(expected) - optional):
        problems.append(f"unexpected tensor {name} in {found[name][1]}")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


def _open(file: Path, framework: str):
    try:
        return safe_open(file, framework=framework)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e


def _read_header(file: Path) -> list[TensorInfo]:
    with _open(file, "np") as f:
        infos = []
        for name in f.keys():
            sl = f.get_slice(name)
            infos.append(TensorInfo(name, tuple(sl.get_shape()), sl.get_dtype(), file))
    return infos


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
