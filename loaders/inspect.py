"""What a checkpoint directory (or gs:// prefix) holds: format, layout, and every tensor."""

import tempfile
from pathlib import Path

from tpu_models.loaders import export_marker
from tpu_models.loaders.hf import CheckpointError, HfCheckpoint

# Names that mark an Orbax checkpoint (or a run/root directory holding one).
ORBAX = ("_METADATA", "checkpoints", "items", "model_params")


def describe(path: str | Path, tunix_families: dict | None = None) -> dict:
    """{"format", "layout", "tensors": [(name, shape, dtype)], "notes"} for HF, MaxText or Tunix.

    tunix_families: name -> loaders.tunix.TunixMapping, to name a Tunix tree's model family."""
    if "://" in str(path):
        if not export_marker.is_gcs(path):
            raise CheckpointError(f"{path}: inspect reads local directories and gs:// (s3:// and "
                                  "az:// are not supported yet)")
        return _describe_gcs(str(path).rstrip("/"), tunix_families)
    path = Path(path)
    orbax = any((path / p).exists() for p in ORBAX)
    if not orbax and (list(path.glob("*.safetensors")) or (path / "adapter_config.json").exists()):
        if (path / "adapter_config.json").exists():
            export_marker.check_export_complete(path, CheckpointError)
            return _adapter(path)
        checkpoint = HfCheckpoint(path)
        return _hf(checkpoint.tensors, len(checkpoint.files))
    return _orbax(path, tunix_families)


def _describe_gcs(uri: str, tunix_families: dict | None) -> dict:
    """The same from a gs:// prefix: safetensors headers through the runai streamer
    (ObjectStorageCheckpoint), Orbax metadata through orbax, adapters copied here."""
    try:
        files, directories = export_marker.list_gcs(uri)
    except Exception as e:  # the client's NotFound, Forbidden, connection errors
        raise CheckpointError(export_marker.storage_failure(uri, export_marker.LISTING, e)) from e
    if not files and not directories:
        raise CheckpointError(f"{uri}: no object under this prefix")
    export_marker.check_export_complete(uri, CheckpointError)
    names = set(files) | directories
    if names & set(ORBAX) or any(d.isdigit() for d in directories):
        return _orbax(uri, tunix_families)
    if "adapter_config.json" in files:
        with tempfile.TemporaryDirectory(prefix="tpu-models-inspect-") as local:
            _download(uri, ("adapter_config.json", "adapter_model.safetensors"), Path(local))
            return _adapter(Path(local))
    from tpu_models.loaders.object_storage import ObjectStorageCheckpoint
    checkpoint = ObjectStorageCheckpoint(uri, tempfile.gettempdir())  # headers only
    return _hf(checkpoint.tensors, len(checkpoint.files))


def _download(uri: str, names: tuple[str, ...], directory: Path) -> None:
    client = export_marker.gcs_client()
    bucket, prefix = export_marker.split_gcs(uri)
    for name in names:
        try:
            client.bucket(bucket).blob(export_marker.gcs_key(prefix, name)).download_to_filename(
                str(directory / name))
        except Exception as e:  # NotFound: the adapter has no weights file
            raise CheckpointError(export_marker.storage_failure(f"{uri}/{name}", "cannot read",
                                                                e)) from e


def _hf(tensors: dict, files: int) -> dict:
    return {"format": "HF safetensors", "layout": f"{files} safetensors file(s)",
            "tensors": [(n, i.shape, i.dtype) for n, i in sorted(tensors.items())], "notes": []}


def _adapter(directory: Path) -> dict:
    from tpu_models.loaders.peft import LoraAdapter
    adapter = LoraAdapter(directory)
    tensors = [(f"{n} (A, B)", (tuple(a.shape), tuple(b.shape)), str(a.dtype))
               for n, (a, b) in sorted(adapter.targets.items())]
    return {"format": "PEFT LoRA adapter", "layout": f"rank {adapter.rank}, alpha "
            f"{adapter.alpha}{', rsLoRA' if adapter.use_rslora else ''}",
            "tensors": tensors, "notes": []}


def _orbax(path: str | Path, tunix_families: dict | None) -> dict:
    from tpu_models.loaders.orbax_io import OrbaxCheckpoint
    orbax = OrbaxCheckpoint(path)
    tensors = [(n, shape, str(dtype)) for n, (shape, dtype) in sorted(orbax.leaves.items())]
    names = set(orbax.leaves)
    if any(n.startswith("params/") for n in names):
        from tpu_models.loaders.maxtext import MaxTextCheckpoint
        maxtext = MaxTextCheckpoint(path)
        return {"format": "MaxText", "layout": maxtext.layout_description(), "tensors": tensors,
                "notes": [f"item directory: {orbax.item}", "opt_state, step and nnx_aux "
                          "entries are ignored by the exporter"]}
    if any("/attn/" in n for n in names):
        from tpu_models.loaders.tunix import TunixCheckpoint
        tunix = TunixCheckpoint(path)
        kind = "LoRA-only (qwix *_lora_a / *_lora_b)" if tunix.is_lora else "full weights"
        family = next((name for name, mapping in (tunix_families or {}).items()
                       if mapping.matches(tunix.leaves)), "unknown family")
        return {"format": "Tunix", "layout": f"{family}, {kind}", "tensors": tensors,
                "notes": [f"item directory: {orbax.item}"]}
    raise CheckpointError(f"{orbax.item}: an Orbax tree neither MaxText nor Tunix lays out")


def print_description(path: str | Path, tunix_families: dict | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    info = describe(path, tunix_families)
    console = Console(width=160)
    console.print(f"[bold]{path}[/bold]: {info['format']} — {info['layout']}")
    for note in info["notes"]:
        console.print(f"  {note}")
    table = Table(show_header=True)
    for column in ("tensor", "shape", "dtype"):
        table.add_column(column)
    for name, shape, dtype in info["tensors"]:
        table.add_row(name, str(list(shape)) if isinstance(shape[0] if shape else 0, int)
                      else str(shape), str(dtype))
    console.print(table)
    console.print(f"{len(info['tensors'])} tensors")
