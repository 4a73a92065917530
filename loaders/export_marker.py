"""Telling a finished export from one cut short, where no rename makes it atomic.

A local export appears in one rename (hf_writer.py). Cloud Storage has no
rename, so an export to gs:// marks its progress with two objects instead:

    1. <out>/tpu-models-export.incomplete   first (tool, start time, source)
    2. the old objects deleted (--overwrite only), then shards, index and side files
    3. <out>/tpu-models-export.json         last: every file written, with its size
    4. the .incomplete marker deleted

`check_export_complete` reads them back, for a gs:// prefix or a local
directory (a downloaded copy): a manifest whose files are all there, each with
its size, passes; an .incomplete marker without a manifest is refused; neither
(a checkpoint uploaded by other means) passes.

loaders/hf.py calls the check, so this module cannot import its CheckpointError:
callers pass the exception class to raise.
"""

import datetime
import json
import os
from pathlib import Path

INDEX = "model.safetensors.index.json"
# What marks a directory (or prefix) as an export we may replace with overwrite=True.
CHECKPOINT_MARKERS = ("config.json", "adapter_config.json", INDEX)
MANIFEST = "tpu-models-export.json"
INCOMPLETE = "tpu-models-export.incomplete"
TOOL = "tpu-models export"
LISTING = "cannot list"  # what storage_failure was doing when a 404 means the bucket


def is_gcs(location) -> bool:
    return str(location).startswith("gs://")


def split_gcs(uri: str) -> tuple[str, str]:
    """gs://bucket/a/b/ -> ("bucket", "a/b")."""
    bucket, _, prefix = str(uri)[len("gs://"):].partition("/")
    return bucket, prefix.strip("/")


def gcs_key(prefix: str, name: str) -> str:
    """The object name of `name` below `prefix` ("" at the bucket's root)."""
    return f"{prefix}/{name}" if prefix else name


def gcs_client():
    """A google-cloud-storage client: anonymous against an emulator (STORAGE_EMULATOR_HOST),
    else the runai streamer's credential settings where it is installed (so a check made
    before serving lists with the credentials that stream), else Application Default
    Credentials. No project: objects and listings need none."""
    from google.cloud import storage

    credentials = None
    if not os.environ.get("STORAGE_EMULATOR_HOST"):
        try:
            from runai_model_streamer_gcs.credentials.credentials import get_credentials
            credentials = get_credentials().gcp_credentials()
        except ImportError:
            pass
    return storage.Client(project=None, credentials=credentials)


def list_gcs(uri: str, *, recursive: bool = False, client=None) -> tuple[dict[str, int], set[str]]:
    """({object name below the prefix: size}, {subdirectory names}), one level unless
    `recursive`. Raises the client's NotFound for a missing bucket."""
    bucket, prefix = split_gcs(uri)
    base = f"{prefix}/" if prefix else ""
    blobs = (client or gcs_client()).list_blobs(bucket, prefix=base,
                                                delimiter=None if recursive else "/")
    files = {b.name[len(base):]: int(b.size) for b in blobs if b.name != base}
    return files, {p[len(base):].rstrip("/") for p in blobs.prefixes}


def storage_failure(uri: str, doing: str, error: Exception) -> str:
    """A storage client's exception as one line naming `uri`."""
    if type(error).__name__ == "NotFound" and doing == LISTING:  # a listing's 404: the bucket
        return f"{uri}: no such bucket gs://{split_gcs(uri)[0]}"
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{uri}: {doing} ({type(error).__name__}: {first})"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tpu-models")
    except PackageNotFoundError:
        return "unknown"


def incomplete_marker(source: str | None) -> dict:
    return {"tool": TOOL, "version": _version(), "started": _now(), "source": source}


def manifest(files: dict[str, int], source: str | None, started: str) -> dict:
    return {"tool": TOOL, "version": _version(), "source": source, "started": started,
            "finished": _now(), "files": dict(sorted(files.items()))}


def check_export_complete(location, error: type[Exception]) -> None:
    """Raises `error` naming each file a manifest lists that is missing or of another size,
    or the missing manifest of an export that wrote only its .incomplete marker."""
    where = str(location).rstrip("/")
    if "://" in where and not is_gcs(where):
        return  # s3://, az://: no export writes there yet
    try:
        state = _gcs_state(where) if is_gcs(where) else _local_state(Path(where))
    except Exception as e:  # each storage client raises its own types
        raise error(storage_failure(where, LISTING, e)) from e
    text, unfinished, size_of = state
    if text is None:
        if unfinished:
            raise error(f"{where}: an unfinished export: {MANIFEST} is missing (tpu-models "
                        "export writes it last; the export was interrupted or is still running)")
        return
    try:
        files = json.loads(text)["files"]
        sizes = {str(name): int(size) for name, size in files.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise error(f"{where}/{MANIFEST}: not a tpu-models export manifest ({e})") from e
    problems = []
    for name, size in sorted(sizes.items()):
        got = size_of(name) if "/" not in name and name not in ("", ".", "..") else None
        if got is None:
            problems.append(f"{where}/{name} is missing")
        elif got != size:
            problems.append(f"{where}/{name} has {got} bytes, {MANIFEST} lists {size}")
    if problems:
        raise error(f"{where}: an incomplete export: " + "; ".join(problems) +
                    f" ({MANIFEST} lists every file the export wrote)")


def _local_state(directory: Path):
    """(manifest text or None, .incomplete there?, name -> size or None)."""
    def size_of(name):
        path = directory / name
        return path.stat().st_size if path.is_file() else None

    manifest_path = directory / MANIFEST
    text = manifest_path.read_text() if manifest_path.is_file() else None
    return text, (directory / INCOMPLETE).exists(), size_of


def _gcs_state(uri: str):
    client = gcs_client()
    files, _ = list_gcs(uri, client=client)
    text = None
    if MANIFEST in files:
        bucket, prefix = split_gcs(uri)
        text = client.bucket(bucket).blob(gcs_key(prefix, MANIFEST)).download_as_text()
    return text, INCOMPLETE in files, files.get
