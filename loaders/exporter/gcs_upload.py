"""The Cloud Storage side of an export to gs:// (HfWriter writes the files).

Cloud Storage has no rename: the markers of export_marker.py go first and last,
each file is uploaded once complete, and on failure this export's objects are
deleted (the .incomplete marker too, unless something could not be).
"""

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tpu_models.loaders import export_marker
from tpu_models.loaders.export_marker import CHECKPOINT_MARKERS, INCOMPLETE, MANIFEST, is_gcs
from tpu_models.loaders.hf import CheckpointError

# Shards uploading at once: one goes up while the next is read and written; two also
# overlap a shard's upload with the next one's (local disk: at most two shards).
UPLOADS_IN_FLIGHT = 2


def check_gcs_out(uri: str, overwrite: bool) -> str:
    """check_out for a gs:// prefix: empty, or an earlier export with `overwrite`."""
    if not is_gcs(uri):
        raise CheckpointError(f"{uri}: exports write to a local directory or gs:// (s3:// and "
                              "az:// are not supported yet)")
    uri = uri.rstrip("/")
    if not export_marker.split_gcs(uri)[1]:
        raise CheckpointError(f"{uri}: give a prefix inside the bucket (gs://BUCKET/NAME): an "
                              "export owns everything under its --out")
    with _storage_errors(uri, export_marker.LISTING):
        files, directories = export_marker.list_gcs(uri)
    if (files or directories) and not overwrite:
        raise CheckpointError(f"{uri} already holds objects (pass --overwrite to replace them)")
    if (files or directories) and not any(
            n in (*CHECKPOINT_MARKERS, MANIFEST, INCOMPLETE) or n.endswith(".safetensors")
            for n in files):
        raise CheckpointError(f"{uri} holds objects that do not look like a checkpoint (no "
                              "config.json, adapter_config.json, *.safetensors or export marker); "
                              "not replacing them, even with --overwrite")
    return uri


@contextlib.contextmanager
def _storage_errors(uri: str, doing: str):
    """Storage client errors as a CheckpointError naming `uri`."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # google-cloud-storage and its transport raise many types
        raise CheckpointError(export_marker.storage_failure(uri, doing, e)) from e


class GcsUpload:
    """One export's objects under a gs:// prefix."""

    def __init__(self, uri: str, *, overwrite: bool, source: str | None):
        self.uri, self.source = check_gcs_out(uri, overwrite), source
        self.uploaded: dict[str, int] = {}  # name below the prefix -> bytes
        self._uploader = ThreadPoolExecutor(UPLOADS_IN_FLIGHT)
        self._in_flight: list = []
        with _storage_errors(self.uri, "cannot write"):
            self.client = export_marker.gcs_client()
            bucket, self.prefix = export_marker.split_gcs(self.uri)
            self.bucket = self.client.bucket(bucket)
            marker = export_marker.incomplete_marker(source)
            self.started = marker["started"]
            self._put_json(INCOMPLETE, marker)
        if overwrite:
            with _storage_errors(self.uri, "cannot delete the old export"):
                old, _ = export_marker.list_gcs(self.uri, recursive=True, client=self.client)
                for name in set(old) - {INCOMPLETE}:
                    self._blob(name).delete()

    def _blob(self, name: str):
        return self.bucket.blob(export_marker.gcs_key(self.prefix, name))

    def _put_json(self, name: str, content: dict) -> None:
        self._blob(name).upload_from_string(json.dumps(content, indent=2) + "\n",
                                            content_type="application/json")

    def upload(self, path: Path, name: str, delete: bool = False) -> None:
        size = self.uploaded[name] = path.stat().st_size  # first: abort deletes a half-finished one
        blob = self._blob(name)
        if size > 8 << 20:  # smaller files go up in one request
            # Resumable uploads send chunks held in memory, 100 MiB by default (multiples of
            # 256 KiB): up to 256 MiB, fewer trips (256 MB to fake-gcs-server: 4.1 s, not 6.4).
            blob.chunk_size = min(256 << 20, -(-size // (256 << 10)) * (256 << 10))
        with _storage_errors(self.uri, f"cannot upload {name}"):
            blob.upload_from_filename(str(path))
        if delete:
            path.unlink()

    def upload_and_delete(self, path: Path, name: str) -> None:
        """Uploads `path` in the background, then deletes it: the next shard's tensors are
        read meanwhile."""
        self.wait(keep=UPLOADS_IN_FLIGHT - 1)
        self._in_flight.append(self._uploader.submit(self.upload, path, name, delete=True))

    def wait(self, keep: int = 0) -> None:
        """Returns once at most `keep` background uploads are running; raises their error."""
        while len(self._in_flight) > keep:
            self._in_flight[0].result()  # interrupted (SIGTERM), it stays for abort to wait on
            self._in_flight.pop(0)

    def move(self, source: str, name: str) -> None:
        """A server-side copy, then the source deleted (Cloud Storage has no rename)."""
        with _storage_errors(self.uri, f"cannot copy {source} to {name}"):
            self.bucket.copy_blob(self._blob(source), self.bucket,
                                  export_marker.gcs_key(self.prefix, name))
            self.uploaded[name] = self.uploaded[source]
            self._blob(source).delete()
            del self.uploaded[source]

    def finish(self) -> None:
        """The manifest, written last; then the .incomplete marker goes."""
        with _storage_errors(self.uri, f"cannot write {MANIFEST}"):
            self._put_json(MANIFEST, export_marker.manifest(self.uploaded, self.source,
                                                            self.started))
            self._blob(INCOMPLETE).delete()
        self._uploader.shutdown()

    def abort(self) -> None:
        """Best effort: whatever cannot be deleted stays behind the .incomplete marker."""
        with contextlib.suppress(Exception):
            self.wait()  # an upload still running would create its object after the deletes
        left = False
        for name in list(self.uploaded):
            try:
                self._blob(name).delete()
                del self.uploaded[name]
            except Exception as e:  # NotFound: gone already
                left = left or type(e).__name__ != "NotFound"
        if not left:
            with contextlib.suppress(Exception):  # else the prefix still reads as unfinished
                self._blob(INCOMPLETE).delete()
        self._uploader.shutdown()
