"""Writing HF checkpoints: sharded safetensors + index, all-or-nothing.

`HfWriter(out)` collects tensors into shards of at most `max_shard_bytes`
(a tensor larger than that gets a shard of its own), writes them into a
temporary directory beside `out`, and renames it to `out` only when
everything, index and side files included, is written. An interrupted or
failed export leaves no directory that looks complete: at most a
`.<out>.partial-<pid>@<host>-*` directory, which the next export to the same
place removes once its process is gone. An existing `out` is refused unless
`overwrite`, and then swapped for the new one in one rename (RENAME_EXCHANGE
where the file system has it), so a failed export leaves the old one intact.
Every file name inside `out` is ours: names coming from elsewhere cannot
place a file outside it.

safetensors writes a file from tensors held in memory, so a shard is queued
before it is written: memory stays bounded by the shard size plus the tensor
being added, whatever the model's size.

A gs:// `out` is written through a local staging directory: each shard is uploaded
in the background once complete and deleted here, so local disk holds at most two
shards. An exporter that knows its tensors' sizes up front (`planned`) knows the
shard count, and each shard goes straight to its HF name; otherwise shards go up
under staging names and are copied to their HF names on the server at the end
(Cloud Storage has no rename). The markers of export_marker.py say when an export
is complete.
"""

import ctypes
import errno
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path, PurePath

import numpy as np
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

from tpu_models.loaders.export_marker import CHECKPOINT_MARKERS, INDEX
from tpu_models.loaders.exporter.gcs_upload import UPLOADS_IN_FLIGHT, GcsUpload, check_gcs_out
from tpu_models.loaders.hf import CheckpointError


def _nbytes(tensor) -> int:
    return int(tensor.nbytes) if isinstance(tensor, np.ndarray) else tensor.numel() * tensor.element_size()


# Where a gs:// export keeps its shards until their HF names are known.
STAGING = "tpu-models-export.staging"


def check_out(out: str | os.PathLike, overwrite: bool) -> Path | str:
    """Refuses an existing `out` unless `overwrite`, and even then anything that is
    not an earlier export (an empty directory, or one with config.json,
    adapter_config.json or *.safetensors): --overwrite replaces checkpoints, never
    a home directory given by mistake. The same for a gs:// prefix (returned as a
    string, without its trailing slash)."""
    if "://" in str(out):
        return check_gcs_out(str(out), overwrite)
    out = Path(out).absolute()
    if not out.exists() and not out.is_symlink():
        return out
    if not overwrite:
        raise CheckpointError(f"{out} already exists (pass --overwrite to replace it)")
    if out.is_symlink() or not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory; not replacing it, even "
                              "with --overwrite")
    entries = list(out.iterdir())
    if entries and not any((out / m).exists() for m in CHECKPOINT_MARKERS) and \
            not any(e.suffix == ".safetensors" for e in entries):
        raise CheckpointError(f"{out} exists and does not look like a checkpoint (no config.json, "
                              "adapter_config.json or *.safetensors); not replacing it, even "
                              "with --overwrite")
    return out


def _partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def remove_stale_partials(out: Path) -> list[Path]:
    """Removes temporary directories of earlier exports to `out` whose process is gone
    (killed half-way): `.<name>.partial-<pid>@<host>-*` on this host, pid not running."""
    removed = []
    host = socket.gethostname()
    prefix = _partial_prefix(out)
    for path in out.parent.iterdir() if out.parent.is_dir() else ():
        if not path.name.startswith(prefix) or not path.is_dir():
            continue
        owner = path.name[len(prefix):].rsplit("-", 1)[0]
        pid, _, owner_host = owner.partition("@")
        if owner_host != host or not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_name(name: str) -> str:
    """A file name inside the output directory: no directories, no way out of it."""
    if not name or PurePath(name).name != name or name in (".", "..") or "/" in name or \
            "\\" in name:
        raise CheckpointError(f"{name!r}: not a plain file name; exports write only their own "
                              "file names inside the output directory")
    return name


def _default_modes(directory: Path) -> None:
    """Modes a plain mkdir/open would give (mkdtemp and safetensors' own temporary
    files make them private to the owner, which other users' servers cannot read)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # not on this file system
        return False
    raise OSError(error, os.strerror(error), str(b))


def _starts_shard(pending: bool, pending_bytes: int, size: int, max_shard_bytes: int) -> bool:
    """Whether a tensor of `size` bytes closes the shard being filled and starts the next."""
    return pending and pending_bytes + size > max_shard_bytes


def shard_count(sizes: Iterable[int], max_shard_bytes: int) -> int:
    """How many shards HfWriter writes for tensors of these sizes, added in this order."""
    count, pending, pending_bytes = 0, False, 0
    for size in sizes:
        if _starts_shard(pending, pending_bytes, size, max_shard_bytes):
            count, pending_bytes = count + 1, 0
        pending, pending_bytes = True, pending_bytes + size
    return count + pending


class HfWriter:

    def __init__(self, out: str | os.PathLike, *, max_shard_bytes: int = 2**30,
                 overwrite: bool = False, weights_name: str = "model", source: str | None = None,
                 planned: list[tuple[str, int]] | None = None):
        """`planned`: every tensor's name and byte size, in the order they will be added
        (an exporter that knows them from metadata): a gs:// export then uploads each
        shard under its final name. A tensor that departs from the plan is refused."""
        self.weights_name = _check_name(weights_name)  # "adapter_model" for PEFT adapters
        self.overwrite = overwrite
        self.max_shard_bytes = max_shard_bytes
        self.planned = planned
        self.planned_shards = None if planned is None else shard_count(
            (size for _, size in planned), max_shard_bytes)
        self.remote: GcsUpload | None = None
        if "://" in str(out):
            self.remote = GcsUpload(str(out), overwrite=overwrite, source=source)
            self.out = self.remote.uri
            self.tmp = Path(tempfile.mkdtemp(prefix="tpu-models-export-"))  # shards in flight
        else:
            self.out = check_out(out, overwrite)
            self.out.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(self.out)
            self.tmp = Path(tempfile.mkdtemp(
                prefix=f"{_partial_prefix(self.out)}{os.getpid()}@{socket.gethostname()}-",
                dir=self.out.parent))
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
        if self.planned is not None:
            self._check_planned(name, size)
        if _starts_shard(bool(self._pending), self._pending_bytes, size, self.max_shard_bytes):
            self._flush()
            self._ship()
        self.names.add(name)
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_bytes += size

    def _check_planned(self, name: str, size: int) -> None:
        index = len(self.names)
        want = self.planned[index] if index < len(self.planned) else None
        if want != (name, size):
            planned = f"{want[0]} of {want[1]} bytes" if want else "no more tensors"
            raise CheckpointError(f"tensor {name} ({size} bytes) written where the export "
                                  f"planned {planned}")

    def add_all(self, tensors: Iterable[tuple[str, object]]) -> None:
        for name, tensor in tensors:
            self.add(name, tensor)

    def _staged(self, index: int) -> Path:
        return self.tmp / f"shard-{index:05d}.safetensors"

    def _flush(self) -> None:
        if self.remote is not None:
            self.remote.wait(keep=UPLOADS_IN_FLIGHT - 1)  # this disk: at most two shards
        if not self._pending:
            return
        path = self._staged(len(self._shards))
        first = next(iter(self._pending.values()))
        tensors = {k: np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v.contiguous()
                   for k, v in self._pending.items()}
        save = save_numpy if isinstance(first, np.ndarray) else save_torch
        save(tensors, path, metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def _shard_name(self, index: int, count: int) -> str:
        return (f"{self.weights_name}.safetensors" if count == 1 else
                f"{self.weights_name}-{index + 1:05d}-of-{count:05d}.safetensors")

    def _ship(self) -> None:
        """gs://: a complete shard goes up, under its HF name where the count is planned."""
        if self.remote is not None:
            index = len(self._shards) - 1
            staged = self._staged(index)
            name = f"{STAGING}/{staged.name}" if self.planned_shards is None else \
                self._shard_name(index, self.planned_shards)
            self.remote.upload_and_delete(staged, name)

    def write_json(self, name: str, content: dict) -> None:
        (self.tmp / _check_name(name)).write_text(
            json.dumps(content, indent=2, sort_keys=True) + "\n")

    def copy_file(self, source: str | os.PathLike, name: str | None = None) -> None:
        shutil.copyfile(source, self.tmp / _check_name(name or Path(source).name))

    def commit(self) -> Path | str:
        """Names the shards HF-style, writes the index, and puts everything in place."""
        if self.planned is not None and len(self.names) < len(self.planned):
            raise CheckpointError(f"tensor {self.planned[len(self.names)][0]} was planned but "
                                  "never written")
        self._flush()
        count = len(self._shards)
        if self.remote is not None and self.planned_shards is not None and count:
            self._ship()  # the last shard, under its HF name like the others
        elif self.remote is not None:
            self.remote.wait()  # the staged shards are all up before they are copied
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = self._shard_name(i, count)
            self._place_shard(i, final)
            weight_map.update({n: final for n in names})
        if count > 1:
            self.write_json(INDEX, {"metadata": {"total_size": self.total_bytes},
                                    "weight_map": dict(sorted(weight_map.items()))})
        if self.remote is None:
            self._move_into_place()
            return self.out
        for path in sorted(self.tmp.iterdir()):  # index, config, tokenizer (unplanned: last shard)
            if not path.name.startswith("shard-"):  # planned: the last shard is going up
                self.remote.upload(path, path.name)
        self.remote.wait()
        self.remote.finish()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return self.out

    def _place_shard(self, index: int, final: str) -> None:
        staged = self._staged(index)
        if self.remote is not None and self.planned_shards is not None:
            return  # uploaded under `final` already
        if staged.exists():  # local, or an unplanned gs:// export's last shard
            staged.rename(self.tmp / final)
        else:  # gs://, unplanned: uploaded when complete, under its staging name
            self.remote.move(f"{STAGING}/{staged.name}", final)

    def _move_into_place(self) -> None:
        """The temporary directory becomes `out`, in one rename."""
        _default_modes(self.tmp)
        if not self.out.exists():
            self.tmp.rename(self.out)
            return
        check_out(self.out, self.overwrite)  # still replaceable (it may have appeared since)
        if _exchange(self.tmp, self.out):  # now self.tmp holds the old export
            shutil.rmtree(self.tmp)
            return
        old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.replaced-", dir=self.out.parent))
        self.out.rename(old / self.out.name)  # no atomic swap here: two renames
        self.tmp.rename(self.out)
        shutil.rmtree(old)

    def abort(self) -> None:
        if self.remote is not None:
            self.remote.abort()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "HfWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise
