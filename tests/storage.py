"""A Cloud Storage server on loopback (fake-gcs-server), and the settings that point
every client at it.

Each client finds an emulator through its own variable; `Bucket.env` sets them
all, with anonymous credentials. TPU_MODELS_TEST_BUCKET=gs://BUCKET[/PREFIX]
runs the same tests against a real bucket instead, with the client libraries'
own credentials (docs/object-storage.md).
"""

import os
import uuid
from pathlib import Path

# Test runs against a real bucket: gs://BUCKET or gs://BUCKET/PREFIX.
REAL_BUCKET = "TPU_MODELS_TEST_BUCKET"


def emulator_env(url: str) -> dict[str, str]:
    """The settings that send every client of ours to the Cloud Storage emulator at `url`."""
    return {
        "STORAGE_EMULATOR_HOST": url,  # google-cloud-storage, gcsfs
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,  # the runai streamer's C++ client
        "TENSORSTORE_GCS_HTTP_URL": url,  # tensorstore (Orbax)
        # No credentials against an emulator: the runai streamer's Python helper
        # (listing, config.json pulls) would otherwise ask google.auth.default().
        "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS": "true",
        "GOOGLE_CLOUD_PROJECT": "test",
        "NO_GCE_CHECK": "true",  # google-auth never asks the cloud metadata server
    }


class Bucket:
    """gs://NAME on a fake-gcs-server (or a real bucket): `upload` a directory, pass
    `env` to the processes that read it."""

    def __init__(self, root: str, env: dict[str, str], client):
        self.root, self.env, self.client = root.rstrip("/"), env, client

    def upload(self, directory: Path, name: str | None = None) -> str:
        """Copies every file of `directory` under a new prefix; returns its gs:// URI."""
        bucket_name, _, prefix = self.root.removeprefix("gs://").partition("/")
        key = "/".join(p for p in (prefix, name or f"ckpt-{uuid.uuid4().hex[:8]}") if p)
        bucket = self.client.bucket(bucket_name)
        for file in sorted(Path(directory).iterdir()):
            if file.is_file():
                bucket.blob(f"{key}/{file.name}").upload_from_filename(str(file))
        return f"gs://{bucket_name}/{key}"

    def upload_tree(self, directory: Path, name: str | None = None) -> str:
        """Copies `directory` and everything below it under a new prefix; returns its URI."""
        bucket_name, _, prefix = self.root.removeprefix("gs://").partition("/")
        key = "/".join(p for p in (prefix, name or f"tree-{uuid.uuid4().hex[:8]}") if p)
        bucket = self.client.bucket(bucket_name)
        for file in sorted(Path(directory).rglob("*")):
            if file.is_file():
                relative = file.relative_to(directory).as_posix()
                bucket.blob(f"{key}/{relative}").upload_from_filename(str(file))
        return f"gs://{bucket_name}/{key}"


def emulated_bucket():
    """Starts fake-gcs-server on a free loopback port with bucket "tpu-models-test";
    yields a Bucket; stops the server after."""
    from google.cloud import storage

    from tpu_models.harness.storage_emulator import emulator

    real = os.environ.get(REAL_BUCKET)
    if real:
        client = storage.Client()  # the client library's own credentials
        yield Bucket(real, {}, client)
        return
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        with emulator("tpu-models-test") as (url, client):
            yield Bucket("gs://tpu-models-test", emulator_env(url), client)
    finally:
        if saved is not None:  # the wrapper unsets it when it stops
            os.environ["STORAGE_EMULATOR_HOST"] = saved
