"""Reading Orbax PyTree checkpoints leaf by leaf, without the library that wrote them.

MaxText and Tunix both save with orbax's PyTreeCheckpointHandler (OCDBT,
zarr); what differs is where the parameter tree sits:

    MaxText   <run>/checkpoints/<step>/items/          params/params/decoder/... (Linen)
    Tunix     <root>/<step>/model_params/              layers/0/attn/... /value (NNX state)

`OrbaxCheckpoint(path)` accepts the run/root directory (newest step), a step
directory or the item directory, lists every leaf from the metadata alone,
and reads one leaf at a time as numpy, so memory stays bounded by the largest
tensor.

A gs:// path works the same: orbax lists and reads its small files through
etils.epath (gcsfs) and tensorstore reads the arrays with its own GCS driver.
"""

import json
import logging
import os
from pathlib import Path

import numpy as np

from tpu_models.loaders import export_marker
from tpu_models.loaders.hf import CheckpointError

# Item directories inside a step directory, in the order we look for them.
ITEMS = ("items", "model_params", "default", "state", "params")


def _is_item(path: Path) -> bool:
    return (path / "_METADATA").exists()


def checkpoint_path(path: str | os.PathLike) -> Path:
    """A local directory as an absolute Path; gs://... as an etils.epath.Path."""
    text = str(path)
    if "://" not in text:
        return Path(path).absolute()
    if not export_marker.is_gcs(text):
        raise CheckpointError(f"{text}: Orbax checkpoints are read from local directories or "
                              "gs:// (s3:// and az:// are not supported yet)")
    _use_emulator()
    from etils import epath
    return epath.Path(text.rstrip("/"))


def _use_emulator() -> None:
    """With a Cloud Storage emulator named, gcsfs talks to it anonymously and tensorstore
    sends a fixed token: neither looks for credentials nor asks a metadata server."""
    url = os.environ.get("STORAGE_EMULATOR_HOST")
    if not url:
        return
    url = url if "://" in url else f"http://{url}"
    import fsspec
    fsspec.config.conf.setdefault("gs", {}).update(token="anon", endpoint_url=url)
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")


def _nothing_there(path) -> str:
    """Why `path` is not a directory: for gs://, a missing bucket or an empty prefix."""
    if not export_marker.is_gcs(path):
        return f"{path}: not a directory"
    try:
        export_marker.list_gcs(str(path))
    except Exception as e:  # the client's NotFound, Forbidden, connection errors
        return export_marker.storage_failure(str(path), export_marker.LISTING, e)
    return f"{path}: no object under this prefix"


def find_item(path: str | os.PathLike) -> Path:
    """The item directory holding the parameter tree under `path`."""
    path = checkpoint_path(path)
    try:
        is_dir = path.is_dir()
    except Exception:  # gcsfs: a missing bucket, refused credentials
        is_dir = False
    if not is_dir:
        raise CheckpointError(_nothing_there(path))
    if _is_item(path):
        return path
    for name in ITEMS:
        if _is_item(path / name):
            return path / name
    steps = sorted((int(p.name), p) for p in path.iterdir() if p.is_dir() and p.name.isdigit())
    if steps:
        return find_item(steps[-1][1])
    # A MaxText run's root; a Tunix RL run's (its policy, `actor/<step>/model_params`).
    for run_dir in ("checkpoints", "actor"):
        if (path / run_dir).is_dir():
            return find_item(path / run_dir)
    raise CheckpointError(f"{path}: no Orbax checkpoint here (looked for _METADATA, "
                          f"{'/'.join(ITEMS)}/, numbered step directories, checkpoints/ "
                          "and actor/)")


class OrbaxCheckpoint:
    """Leaves of an Orbax PyTree checkpoint: '/'-joined path -> (shape, dtype)."""

    def __init__(self, path: str | os.PathLike):
        import orbax.checkpoint as ocp

        self.item = find_item(path)
        self._checkpointer = ocp.PyTreeCheckpointer()
        logging.getLogger("absl").setLevel(logging.ERROR)  # "no _CHECKPOINT_METADATA" chatter
        try:
            tree = self._checkpointer.metadata(self.item).item_metadata.tree
        except Exception as e:  # orbax raises many types for damaged checkpoints
            raise CheckpointError(f"{self.item}: cannot read Orbax metadata ({e})") from e
        self.leaves: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self._keys: dict[str, tuple] = {}
        for keys, leaf in _flatten(tree):
            name = "/".join(keys)
            self.leaves[name] = (tuple(leaf.shape), np.dtype(leaf.dtype))
            self._keys[name] = keys

    @property
    def custom_metadata(self) -> dict:
        """The step's `custom_metadata` (Tunix/orbax CheckpointManager), if any."""
        for directory in (self.item, self.item.parent):
            meta = directory / "_CHECKPOINT_METADATA"
            if meta.exists():
                try:
                    return json.loads(meta.read_text()).get("custom_metadata") or {}
                except json.JSONDecodeError:
                    return {}
        return {}

    def read(self, name: str) -> np.ndarray:
        """One leaf, as numpy."""
        import orbax.checkpoint as ocp

        keys = self._keys[name]
        shape, dtype = self.leaves[name]
        item = restore_args = None
        for key in reversed(keys):
            item = {key: item if item is not None else np.zeros((), dtype)}
            restore_args = {key: restore_args if restore_args is not None else
                            ocp.RestoreArgs(restore_type=np.ndarray)}
        try:
            out = self._checkpointer.restore(self.item, args=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True))
        except Exception as e:
            raise CheckpointError(f"{self.item}: cannot read tensor {name} ({e})") from e
        for key in keys:
            out = out[key]
        if tuple(out.shape) != shape:
            raise CheckpointError(f"{self.item}: tensor {name} has shape {list(out.shape)}, its "
                                  f"metadata says {list(shape)} (truncated checkpoint?)")
        return out


def _flatten(tree, prefix=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, prefix + (str(key), ))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _flatten(value, prefix + (str(i), ))
    elif tree is not None and hasattr(tree, "shape"):
        yield prefix, tree
