"""Checkpoints in object storage (gs://, s3://, az://), listed from their safetensors headers.

vLLM's `--load-format runai_streamer` pulls config.json and the tokenizer into a
local directory and streams the safetensors through Run:ai's model streamer.
Before that stream starts, `ObjectStorageCheckpoint` lists the same files and
reads each one's 8-byte length and header through the same streamer (its
client, credentials and emulator setting), so a checkpoint is checked against
its name/shape table as a local one is, with no weight read. In Cloud Storage
and S3 it also records each object's size and version (generation, ETag): a
file cut short is refused before streaming, and one replaced while it was read
is refused after.

Small things (LoRA adapters, speculative drafts) are copied instead:
`local_copy` pulls them into a temporary directory with the streamer's own
helper. `checked_stream` watches the weight stream itself: a storage server that
stops answering is named within a minute, not after the streamer's 15 minutes
of retries.
"""

import atexit
import contextlib
import json
import os
import queue
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from tpu_models.loaders import export_marker
from tpu_models.loaders.hf import MAX_HEADER_BYTES, CheckpointError, TensorInfo, header_tensors

SCHEMES = ("gs://", "s3://", "az://")  # the streamer's, as vLLM's runai_utils lists them


def is_object_storage(uri: str) -> bool:
    return str(uri).lower().startswith(SCHEMES)


def refuse_an_unfinished_export(model) -> None:
    """Raises CheckpointError, naming the prefix and each fault, where `model` (an
    object-storage prefix, or a local directory: a copy of one) is an export that
    `tpu-models export` left unfinished (export_marker). Our model classes check the
    markers when they open the checkpoint; tpu-inference's own classes (a plain Qwen3
    export) never looked, and were served. vLLM builds a ModelConfig for every model
    it serves (the target, a speculative draft) and pulls an object-storage model's
    config.json and tokenizer there, before any weight is read: the seam calls this
    at that point, for every architecture, under plain `vllm serve` as under
    `tpu-models serve`."""
    if is_object_storage(str(model)) or os.path.isdir(model):
        export_marker.check_export_complete(model, CheckpointError)


class ObjectStorageCheckpoint:
    """The safetensors files under `uri` and the tensors in them (as HfCheckpoint's)."""

    def __init__(self, uri: str, directory: str | Path):
        from runai_model_streamer import list_safetensors
        self.source = uri.rstrip("/")  # where the user put it: error messages name it
        export_marker.check_export_complete(self.source, CheckpointError)  # tpu-models export's markers
        self.directory = Path(directory)  # its config.json and tokenizer, pulled by vLLM
        with _named(self.source, export_marker.LISTING):
            self.files = sorted(list_safetensors(self.source))
        if not self.files:
            raise CheckpointError(f"{self.source}: no *.safetensors files")
        # uri -> (size, version), where the store tells them (Cloud Storage, S3).
        self.versions = object_versions(self.source)
        self.tensors: dict[str, TensorInfo] = {}
        for uri_of_file, (length, header) in zip(self.files, _read_headers(self.files)):
            file = PurePosixPath(uri_of_file.split("://", 1)[1])
            size = self.versions[uri_of_file][0] if uri_of_file in self.versions else None
            data_bytes = None if size is None else size - 8 - length
            for info in header_tensors(file, header, data_bytes, header_bytes=8 + length,
                                       size=size, where=uri_of_file):
                if info.name in self.tensors:
                    raise CheckpointError(
                        f"{info.name}: stored twice, in {self.tensors[info.name].file.name} "
                        f"and {file.name}")
                self.tensors[info.name] = info

    def check_unchanged(self) -> None:
        """Refuses files replaced (or removed) since their headers were read: the stream
        may have mixed two versions."""
        now = object_versions(self.source)
        for uri, (size, version) in self.versions.items():
            if uri not in now:
                raise CheckpointError(f"{uri}: removed while its weights were read")
            if now[uri] != (size, version):
                raise CheckpointError(
                    f"{uri}: replaced while its weights were read (version {version}, "
                    f"{size} bytes -> version {now[uri][1]}, {now[uri][0]} bytes); nothing "
                    "loaded from a mix of versions: start again to load the new one")


    def check_reachable(self, unread: list[str], waited: float, timeouts: int) -> int:
        """Called when the stream has given nothing for `waited` seconds: asks the
        storage server for a listing (10 s). Answered: returns 0. Refused (the server
        is gone): raises, naming the files not yet read, rather than wait on the
        streamer's client, which retries for 15 minutes. Timed out (gone, or too busy
        to answer): returns the count of timeouts in a row, raising at the third."""
        try:
            object_versions(self.source, timeout=10)
            return 0
        except CheckpointError as e:
            if _timed_out(e) and timeouts + 1 < 3:
                return timeouts + 1
            raise CheckpointError(
                f"{', '.join(unread) or self.source}: the storage server stopped answering "
                f"while the weights were read (nothing for {waited:.0f} s; {e})") from e


def _timed_out(error: BaseException) -> bool:
    """Whether a client library's error (any of its causes) is a timeout."""
    while error is not None:
        if isinstance(error, TimeoutError) or "timeout" in type(error).__name__.lower() \
                or "timed out" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def object_versions(uri: str, timeout: float | None = None) -> dict[str, tuple[int, str]]:
    """Each *.safetensors object directly under `uri` -> (size in bytes, version: its
    generation in Cloud Storage, its ETag in S3), listed with the credentials the
    streamer uses; {} for other stores. With a `timeout`: one try of at most that
    many seconds."""
    scheme, _, rest = uri.partition("://")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    with _named(uri, export_marker.LISTING):
        if scheme.lower() == "gs":
            return _gcs_versions(bucket, prefix, timeout)
        if scheme.lower() == "s3":
            return _s3_versions(bucket, prefix, timeout)
    return {}


def _gcs_versions(bucket: str, prefix: str, timeout: float | None) -> dict:
    from google.cloud.storage.retry import DEFAULT_RETRY

    blobs = export_marker.gcs_client().list_blobs(
        bucket, prefix=prefix, delimiter="/", timeout=timeout or 60,
        retry=None if timeout else DEFAULT_RETRY)
    return {f"gs://{bucket}/{b.name}": (int(b.size), str(b.generation))
            for b in blobs if b.name.endswith(".safetensors")}


def _s3_versions(bucket: str, prefix: str, timeout: float | None) -> dict:
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=timeout, read_timeout=timeout,
                    retries={"max_attempts": 1}) if timeout else None
    pages = boto3.client("s3", config=config).get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix, Delimiter="/")
    return {f"s3://{bucket}/{o['Key']}": (int(o["Size"]), o["ETag"].strip('"'))
            for page in pages for o in page.get("Contents", ())
            if o["Key"].endswith(".safetensors")}


@contextlib.contextmanager
def local_copy(uri: str, names: tuple[str, ...] | None = None) -> Iterator[Path]:
    """The files under `uri` (those called `names`, or all), in a temporary directory
    removed on leaving the block. For small things only: adapters, drafts."""
    from runai_model_streamer import pull_files

    prefix = uri.rstrip("/") + "/"
    patterns = None if names is None else [p for n in names for p in (n, f"*/{n}")]
    with tempfile.TemporaryDirectory(prefix="tpu-models-copy-") as local:
        with _named(uri, "cannot copy"):
            pull_files(prefix, local, allow_pattern=patterns)
        if not any(Path(local).iterdir()):
            wanted = f" (looked for {', '.join(names)})" if names else ""
            raise CheckpointError(f"{uri}: nothing there{wanted}")
        yield Path(local)


def local_draft(uri: str, mirror) -> str:
    """A speculative draft's files pulled whole into `mirror(uri).dir` (vLLM's
    ObjectStorageModel: its assets cache, one directory per URI); returns it."""
    export_marker.check_export_complete(uri, CheckpointError)  # a draft export cut short
    target = mirror(uri)
    with _named(uri, "cannot copy the draft"):
        target.pull_files(uri)
    if not (Path(target.dir) / "config.json").exists():
        raise CheckpointError(f"{uri}: no config.json (a speculative draft checkpoint)")
    return target.dir


@contextlib.contextmanager
def _named(uri: str, doing: str):
    """Storage clients' errors (a missing bucket, refused credentials, an unreachable
    server) as a CheckpointError naming `uri`; their own message kept, first line."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # each client library raises its own types
        raise CheckpointError(export_marker.storage_failure(uri, doing, e)) from e


def _read_headers(files: list[str]) -> list[tuple[int, dict]]:
    """Each file's header length and header as JSON: two small reads per file."""
    from runai_model_streamer import FileChunks, FileStreamer

    def read(requests: dict[int, tuple[int, int]]) -> dict[int, bytes]:
        with _named(files[0].rsplit("/", 1)[0], "cannot read safetensors headers"), \
                FileStreamer() as streamer:
            streamer.stream_files([FileChunks(i, files[i], offset, [size])
                                   for i, (offset, size) in requests.items()])
            # Chunks are views of the streamer's buffer: copied out as they arrive.
            return {i: chunk.numpy().tobytes() for i, _, chunk in streamer.get_chunks()}

    lengths = {i: int.from_bytes(raw, "little")
               for i, raw in read({i: (0, 8) for i in range(len(files))}).items()}
    for i, length in lengths.items():
        if not 0 < length <= MAX_HEADER_BYTES:
            raise CheckpointError(f"{files[i]}: not a safetensors file: its first 8 bytes "
                                  f"announce a {length}-byte header")
    raws = read({i: (8, length) for i, length in lengths.items()})
    headers = []
    for i, file in enumerate(files):
        try:
            headers.append((lengths[i], json.loads(raws[i].decode("utf-8"))))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: corrupted safetensors header: not valid JSON "
                                  f"({e})") from e
    return headers


# --- the weight stream, watched --------------------------------------------------

# Seconds without a streamed tensor before we ask whether the storage server still answers.
STREAM_STALL = "TPU_MODELS_STREAM_STALL_S"


def checked_stream(weights, checkpoint):
    """The stream, its failures naming the checkpoint, refused if the storage server
    stops answering, and refused at its end if an object changed while it was read."""
    try:
        yield from _watched(weights, checkpoint)
    except CheckpointError:
        raise
    except Exception as e:  # the streamer's own errors: a lost connection, a short read
        raise CheckpointError(f"{checkpoint.source}: streaming the weights failed "
                              f"({type(e).__name__}: {e})") from e
    if isinstance(checkpoint, ObjectStorageCheckpoint):
        checkpoint.check_unchanged()


def _exit_past_the_streamer() -> None:
    # The streamer's client thread keeps retrying the lost server, and its C++
    # destructors wait for it at exit (15 minutes): leave before they run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _watched(weights, checkpoint):
    """`weights`, each item fetched on a helper thread only when asked for (the
    streamer may reuse a tensor's buffer for the next), so that a stream stuck on a
    storage server that went away is noticed: every STREAM_STALL_S seconds without
    a tensor, the server is asked for a listing (a large tensor from a busy server
    may take longer; only a server that refuses, or times out three times in a
    row, ends the load)."""
    if not isinstance(checkpoint, ObjectStorageCheckpoint):
        yield from weights
        return
    stall = float(os.environ.get(STREAM_STALL, "20"))
    asks, replies = queue.Queue(), queue.Queue()

    def fetch():
        while asks.get():
            try:
                replies.put(("tensor", next(weights)))
            except StopIteration:
                replies.put(("end", None))
                return
            except BaseException as e:  # handed to the consumer, raised there
                replies.put(("error", e))
                return

    threading.Thread(target=fetch, daemon=True, name="tpu-models-weight-stream").start()
    unread = {i.name: i.file for i in checkpoint.tensors.values()}
    timeouts = 0
    try:
        while True:
            asks.put(True)
            waited = 0.0
            while True:
                try:
                    kind, item = replies.get(timeout=stall)
                    break
                except queue.Empty:
                    waited += stall
                    scheme = checkpoint.source.split("://", 1)[0]
                    files = sorted({f"{scheme}://{f}" for f in unread.values()})
                    try:
                        timeouts = checkpoint.check_reachable(files, waited, timeouts)
                    except CheckpointError:
                        atexit.register(_exit_past_the_streamer)
                        raise
            if kind == "end":
                return
            if kind == "error":
                raise item
            unread.pop(item[0], None)
            yield item
    finally:
        asks.put(False)  # a thread still inside the streamer stays there: the load failed
