"""Reading HF checkpoints: safetensors only, single file or sharded.

`HfCheckpoint(dir)` lists every tensor (name, shape, dtype, file) from the
safetensors headers alone, so a checkpoint can be checked against its name/shape
table (see `tables.py`) before a single weight is read. Each header is parsed
and checked against its file's size here, so a truncated or corrupted file is
refused in milliseconds, naming the file and the tensor whose bytes are missing.
Pickle formats (.bin, .pt) are refused: loading them can run arbitrary code.
Index entries are file names inside the directory, never paths out of it.
"""

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath

from safetensors import SafetensorError, safe_open

from tpu_models.loaders.export_marker import check_export_complete

INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# Bits per element of every dtype the safetensors format defines.
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
              "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
              "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


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
        self.source = self.directory  # where the tensors live, as messages name it
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        check_export_complete(self.directory, CheckpointError)  # a copy of an unfinished export
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
            for name in sorted(set(map(str, weight_map.values()))):
                _check_entry(index, name, self.directory)
            files = sorted({self.directory / f for f in weight_map.values()})
            for f in files:
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

    def iter_tensors(self, framework: str = "pt", *, check_finite: bool = False
                     ) -> Iterator[tuple[str, object]]:
        """Yields (name, tensor) file by file, holding one tensor at a time.

        Each tensor is read through a mapping of its own, closed before it is
        yielded: a mapping kept open for the whole file keeps every page read so
        far resident, so loading a 2 GB file held up to 2 GB beside the weights.

        check_finite: refuse the first tensor holding a NaN or an infinity (one
        extra pass over each tensor's memory; torch tensors only)."""
        for file in self.files:
            for name in [n for n, info in self.tensors.items() if info.file == file]:
                with _open(file, framework) as f:
                    try:
                        tensor = f.get_tensor(name)
                    except SafetensorError as e:
                        raise CheckpointError(f"{file}: tensor {name} cannot be read: {e}") from e
                if check_finite:
                    check_finite_tensor(tensor, f"{file}: tensor {name}")
                yield name, tensor


def check_finite(tensors: Iterable[tuple[str, object]], where: str
                 ) -> Iterator[tuple[str, object]]:
    """Streams (name, tensor) through, refusing the first with a NaN or an infinity."""
    for name, tensor in tensors:
        check_finite_tensor(tensor, f"{where}: tensor {name}")
        yield name, tensor


def check_finite_tensor(tensor, what: str) -> None:
    """Raises CheckpointError naming `what` if the torch tensor holds NaN or +-inf."""
    nan, inf = count_nonfinite(tensor)
    if nan or inf:
        parts = [f"{n} {kind}" for n, kind in ((nan, "NaN"), (inf, "infinite")) if n]
        raise CheckpointError(f"{what} {list(tensor.shape)} holds {' and '.join(parts)} "
                              f"value{'s' if nan + inf > 1 else ''} (of {tensor.numel()})")


def count_nonfinite(tensor, chunk: int = 1 << 24) -> tuple[int, int]:
    """(NaN count, infinity count) of a torch tensor, a chunk at a time (bounded memory)."""
    import torch
    if not tensor.is_floating_point():
        return 0, 0
    nan = inf = 0
    for part in tensor.reshape(-1).split(chunk):
        if part.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            part = part.float()  # fp8: no isnan/isinf kernels on CPU
        nan += int(part.isnan().sum())
        inf += int(part.isinf().sum())
    return nan, inf


def check_tensors(found: Mapping[str, tuple[tuple[int, ...], str]],
                  expected: Mapping[str, tuple[int, ...]], *, optional: Iterable[str] = (),
                  where: str = "checkpoint") -> None:
    """found: name -> (shape, file). Lists every missing, unexpected and misshapen tensor."""
    problems = tensor_problems(found, expected, optional=optional)
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


def tensor_problems(found: Mapping[str, tuple[tuple[int, ...], str]],
                    expected: Mapping[str, tuple[int, ...]], *, optional: Iterable[str] = ()
                    ) -> list[str]:
    """Every missing, unexpected and misshapen tensor, one line each."""
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
    return problems


def _open(file: Path, framework: str):
    try:
        return safe_open(file, framework=framework)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e


def _check_entry(index: Path, name: str, directory: Path) -> None:
    """An index entry must name a safetensors file inside the checkpoint directory."""
    path = PurePosixPath(name)
    if not name or "\\" in name or path.is_absolute() or ".." in path.parts:
        raise CheckpointError(f"{index}: weight_map entry {name!r} lies outside {directory}; "
                              "entries must be file names inside the checkpoint directory")
    if name.endswith(PICKLE_SUFFIXES):
        raise CheckpointError(f"{index}: names {name}, a pickle file; tpu-models loads "
                              "safetensors only, since unpickling can run arbitrary code")


def _read_header(file: Path) -> list[TensorInfo]:
    """The tensors of one safetensors file, from its header, checked against the file size.

    Layout: 8-byte little-endian header length N, N bytes of JSON
    {name: {dtype, shape, data_offsets: [begin, end]}}, then the data, each
    tensor's bytes at data_offsets, back to back, to the end of the file.
    """
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
            raw = f.read(length) if length is not None and length <= min(
                MAX_HEADER_BYTES, size - 8) else None
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e})") from e
    if length is None:
        raise CheckpointError(f"{file}: truncated: {size} bytes, too short for a safetensors "
                              "header")
    if raw is None and prefix.startswith((b"PK\x03\x04", b"\x80")):  # torch.save: zip, pickle
        raise CheckpointError(f"{file}: a pickle (torch.save) file, not safetensors; tpu-models "
                              "loads safetensors only, since unpickling can run arbitrary code")
    if raw is None:
        raise CheckpointError(f"{file}: not a safetensors file, or truncated: its first 8 bytes "
                              f"announce a {length}-byte header, the file has {size} bytes")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: corrupted safetensors header: not valid JSON ({e})") from e
    return header_tensors(file, header, size - 8 - length, header_bytes=8 + length, size=size)


def header_tensors(file, header, data_bytes: int | None, *, header_bytes: int = 0,
                   size: int | None = None, where: str | None = None) -> list[TensorInfo]:
    """The tensors a parsed safetensors header describes, each checked: a known dtype,
    a shape its bytes fit, spans back to back. data_bytes: the bytes after the header,
    None when unknown (object storage: the end is then not checked against the file's);
    where: the file as messages name it (default `file`)."""
    where = where or file
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: corrupted safetensors header: not a JSON object")
    infos, spans = [], []
    for name, entry in header.items():
        if name == "__metadata__":
            continue

        def bad(what: str) -> CheckpointError:
            return CheckpointError(f"{where}: corrupted safetensors header: tensor {name} {what}")

        if not isinstance(entry, dict):
            raise bad("is not described by a JSON object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise bad(f"has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise bad(f"has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
                and offsets[0] <= offsets[1]):
            raise bad(f"has invalid data_offsets {offsets!r}")
        need = (math.prod(shape) * DTYPE_BITS[dtype] + 7) // 8
        if offsets[1] - offsets[0] != need:
            raise bad(f"{dtype} {shape} needs {need} bytes but its data_offsets {offsets} span "
                      f"{offsets[1] - offsets[0]}")
        spans.append((offsets[0], offsets[1], name))
        infos.append(TensorInfo(name, tuple(shape), dtype, file))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise CheckpointError(f"{where}: corrupted safetensors header: tensor {name} starts at "
                                  f"data byte {begin}, expected {end} (overlapping or a gap)")
        if data_bytes is not None and stop > data_bytes:
            raise CheckpointError(
                f"{where}: truncated: tensor {name} needs bytes {header_bytes + begin}.."
                f"{header_bytes + stop} but the file ends at {size} (a complete file has "
                f"{header_bytes + max(s[1] for s in spans)} bytes)")
        end = stop
    if data_bytes is not None and end != data_bytes:
        raise CheckpointError(f"{where}: corrupted: {data_bytes - end} bytes after the last "
                              f"tensor (the header accounts for {header_bytes + end} of {size} bytes)")
    return infos


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
