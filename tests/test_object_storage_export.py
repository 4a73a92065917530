"""Exports from and to Cloud Storage, and inspect gs://, against a real storage server on
loopback (fake-gcs-server): the same bytes as a local export, the marker protocol of
loaders/export_marker.py when an export fails or is killed, --overwrite on a prefix,
and errors naming the gs:// path."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tpu_models.loaders.exporter import convert as export, hf_writer
from tpu_models.loaders.exporter.convert import maxtext, tunix
from tpu_models.loaders.export_marker import INCOMPLETE, MANIFEST, check_export_complete
from tpu_models.loaders.hf import CheckpointError, HfCheckpoint
from tpu_models.loaders.inspect import describe
from tpu_models.loaders.object_storage import ObjectStorageCheckpoint
from tpu_models.loaders.orbax_io import OrbaxCheckpoint
from tpu_models import registry
from tpu_models.server import cli
from tests.storage import emulated_bucket
from tests.test_object_storage import SENTINEL, credentials
from tests.test_export_tunix import hf_config_dir

ROOT = Path(__file__).parents[1]
MAXTEXT = ROOT / "tests" / "fixtures" / "maxtext" / "qwen3_unscanned"
TUNIX = ROOT / "tests" / "fixtures" / "tunix" / "qwen3_tied"
QWEN3 = registry.by_export_name("qwen3")
SHARD = 100_000  # bytes: the fixture's 430 kB export in five shards


@pytest.fixture(scope="module")
def bucket():
    for bucket in emulated_bucket():
        with pytest.MonkeyPatch.context() as env:  # undone before the server stops
            for name, value in bucket.env.items():  # in-process exports and inspect
                env.setenv(name, value)
            yield bucket


@pytest.fixture(scope="module")
def maxtext_uri(bucket):
    return bucket.upload_tree(MAXTEXT, "sources/maxtext-qwen3")


@pytest.fixture(scope="module")
def local_export(tmp_path_factory):
    return maxtext(MAXTEXT, QWEN3, tmp_path_factory.mktemp("local") / "hf", max_shard_bytes=SHARD)


def objects(bucket, uri: str) -> dict[str, bytes]:
    """Every object under `uri`: name below the prefix -> content."""
    name, _, prefix = uri.removeprefix("gs://").partition("/")
    return {b.name[len(prefix) + 1:]: b.download_as_bytes()
            for b in bucket.client.list_blobs(name, prefix=prefix + "/")}


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def blob(bucket, uri: str):
    name, _, key = uri.removeprefix("gs://").partition("/")
    return bucket.client.bucket(name).blob(key)


def assert_same_export(remote: dict[str, bytes], local: dict[str, bytes], source: str):
    """The files of a local export, byte for byte, plus a manifest listing each one's size."""
    manifest = json.loads(remote.pop(MANIFEST))
    assert remote == local
    assert manifest["files"] == {name: len(content) for name, content in local.items()}
    assert manifest["source"] == source and manifest["tool"] == "tpu-models export"


def test_gs_to_gs_export_is_the_local_export_byte_for_byte(bucket, maxtext_uri, local_export,
                                                          monkeypatch):
    upload, uploaded = hf_writer.GcsUpload.upload, []
    monkeypatch.setattr(hf_writer.GcsUpload, "upload",
                        lambda self, path, name, delete=False: (uploaded.append(name),
                                                                upload(self, path, name, delete)))
    out = maxtext(maxtext_uri, QWEN3, f"{bucket.root}/gs-to-gs", max_shard_bytes=SHARD)
    assert out == f"{bucket.root}/gs-to-gs"
    # Sizes known from metadata: each shard went up once, under its final name.
    assert sorted(uploaded) == sorted(files(local_export))
    assert_same_export(objects(bucket, out), files(local_export), maxtext_uri)  # 5 shards
    # ... and both equal the fixture's independent numpy conversion (test_export_maxtext.py)
    reference = load_file(MAXTEXT / "hf_reference.safetensors")
    exported = {}
    for path in sorted(local_export.glob("*.safetensors")):
        exported.update(load_file(path))
    assert exported.keys() == reference.keys()
    for name, array in reference.items():
        np.testing.assert_array_equal(exported[name], array, err_msg=name)  # Qwen3: copies
    assert OrbaxCheckpoint(maxtext_uri).custom_metadata == {"scan_layers": False}  # step's file
    check_export_complete(out, CheckpointError)
    remote, local = ObjectStorageCheckpoint(out, local_export), HfCheckpoint(local_export)
    assert ({n: (i.shape, i.dtype, i.file.name) for n, i in remote.tensors.items()} ==
            {n: (i.shape, i.dtype, i.file.name) for n, i in local.tensors.items()})


def test_gs_to_local_and_local_to_gs(bucket, maxtext_uri, local_export, tmp_path):
    out = maxtext(maxtext_uri, QWEN3, tmp_path / "hf", max_shard_bytes=SHARD)
    assert files(out) == files(local_export)  # no marker files in a local export
    uri = maxtext(MAXTEXT, QWEN3, f"{bucket.root}/local-to-gs", max_shard_bytes=SHARD)
    assert_same_export(objects(bucket, uri), files(local_export), str(MAXTEXT))


def test_an_export_of_unplanned_sizes_stages_its_shards_and_copies_them(
        bucket, maxtext_uri, local_export, monkeypatch):
    """Tensors whose sizes are not known up front (lora-merge and gemma3-text exports) go
    up under staging names and are copied to their HF names at the end: the same files."""
    planned = export._planned
    monkeypatch.setattr(export, "_planned", lambda *args: (planned(*args)[0], None))
    out = maxtext(maxtext_uri, QWEN3, f"{bucket.root}/unplanned", max_shard_bytes=SHARD)
    assert_same_export(objects(bucket, out), files(local_export), maxtext_uri)  # staging gone


def test_tunix_full_weights_and_lora_adapter_from_gs(bucket, tmp_path):
    base = hf_config_dir("qwen3_tied", tmp_path)
    source = bucket.upload_tree(TUNIX / "full_ckpt", "sources/tunix-full")
    local = tunix(TUNIX / "full_ckpt", base, tmp_path / "full", arch=QWEN3)
    uri = tunix(source, base, f"{bucket.root}/tunix-full", arch=QWEN3)
    assert_same_export(objects(bucket, uri), files(local), source)

    lora = bucket.upload_tree(TUNIX / "lora_ckpt", "sources/tunix-lora")
    alpha = json.loads((TUNIX / "meta.json").read_text())["lora"]["alpha"]
    adapter = tunix(lora, local, f"{bucket.root}/tunix-adapter", arch=QWEN3, lora_alpha=alpha,
                    adapter_only=True)
    local_adapter = tunix(TUNIX / "lora_ckpt", local, tmp_path / "adapter", arch=QWEN3,
                          lora_alpha=alpha, adapter_only=True)
    remote = objects(bucket, adapter)
    remote.pop(MANIFEST)
    assert remote == files(local_adapter)
    assert describe(adapter)["layout"] == describe(local_adapter)["layout"] == \
        f"rank {json.loads(remote['adapter_config.json'])['r']}, alpha {float(alpha)}"


def test_a_failing_export_removes_what_it_uploaded(bucket, maxtext_uri, monkeypatch):
    """A tensor that fails to read after shards went up: nothing left, markers included."""
    read, calls = OrbaxCheckpoint.read, []

    def failing(self, name):
        calls.append(name)
        if len(calls) == 20:
            raise CheckpointError(f"{self.item}: cannot read tensor {name} (simulated)")
        return read(self, name)

    upload, uploads = hf_writer.GcsUpload.upload, []

    def counted(self, path, name, delete=False):
        uploads.append(name)
        upload(self, path, name, delete)

    monkeypatch.setattr(OrbaxCheckpoint, "read", failing)
    monkeypatch.setattr(hf_writer.GcsUpload, "upload", counted)
    out = f"{bucket.root}/failing-read"
    with pytest.raises(CheckpointError, match="simulated"):
        maxtext(maxtext_uri, QWEN3, out, max_shard_bytes=SHARD)
    assert len(uploads) > 1 and objects(bucket, out) == {}


def test_an_export_that_cannot_clean_up_is_refused_naming_the_manifest(
        bucket, maxtext_uri, monkeypatch):
    """The connection goes after the first shard: uploads and deletes fail. The
    .incomplete marker stays; every reader refuses the prefix."""
    upload, uploads = hf_writer.GcsUpload.upload, []

    def failing_upload(self, path, name, delete=False):
        uploads.append(name)
        if len(uploads) > 1:
            monkeypatch.setattr(type(self.bucket.blob("x")), "delete", broken)
            raise CheckpointError(f"{self.uri}: cannot upload {name} (simulated)")
        upload(self, path, name, delete)

    def broken(*args, **kwargs):
        raise ConnectionError("simulated")

    monkeypatch.setattr(hf_writer.GcsUpload, "upload", failing_upload)
    out = f"{bucket.root}/cut-off"
    with pytest.raises(CheckpointError, match="simulated"):
        maxtext(maxtext_uri, QWEN3, out, max_shard_bytes=SHARD)
    monkeypatch.undo()
    assert sorted(objects(bucket, out)) == ["model-00001-of-00005.safetensors", INCOMPLETE]
    assert_unfinished(out)


def assert_unfinished(uri: str) -> None:
    message = (f"{uri}: an unfinished export: {MANIFEST} is missing (tpu-models export writes "
               "it last; the export was interrupted or is still running)")
    for refuse in (lambda: check_export_complete(uri, CheckpointError),
                   lambda: ObjectStorageCheckpoint(uri, "/nonexistent")):
        with pytest.raises(CheckpointError) as error:
            refuse()
        assert str(error.value) == message
    with pytest.raises(SystemExit) as error:
        cli.main(["inspect", uri])
    assert str(error.value) == f"tpu-models inspect: {message}"


# `tpu-models export`, stopped once its first shard is uploaded (to be killed there).
STOPPED_CLI = """
import os, sys, time
from tpu_models.loaders.exporter import convert as export, hf_writer
wait, stopped = hf_writer.GcsUpload.wait, []
def stop(self, keep=0):
    wait(self)
    if self.uploaded and not stopped:
        stopped.append(True)
        open(os.environ["STOP_SIGNAL"], "w").close()
        time.sleep(600)
hf_writer.GcsUpload.wait = stop
from tpu_models.server.cli import main
main(sys.argv[1:])
"""


def export_cli(bucket, args: list[str], tmp_path: Path, stop_with: int | None = None):
    """Runs `tpu-models export maxtext` (in a process of its own, pointed at the emulator by
    STORAGE_EMULATOR_HOST alone); with `stop_with`, sends that signal after one upload."""
    stopped = tmp_path / f"stopped-{stop_with}"
    env = {**os.environ, "STORAGE_EMULATOR_HOST": bucket.env["STORAGE_EMULATOR_HOST"],
           "JAX_PLATFORMS": "cpu", "STOP_SIGNAL": str(stopped), "TMPDIR": str(tmp_path),
           **credentials(tmp_path)}  # a sentinel secret: found in no output
    for name in ("TENSORSTORE_GCS_HTTP_URL", "CLOUD_STORAGE_EMULATOR_ENDPOINT"):
        env.pop(name, None)  # cli.py derives them
    command = ["export", "maxtext", *args, "--model", "qwen3", "--max-shard-size", str(SHARD)]
    if stop_with is None:
        return subprocess.run([sys.executable, "-m", "tpu_models.server.cli", *command], env=env,
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
    process = subprocess.Popen([sys.executable, "-c", STOPPED_CLI, *command], env=env,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not stopped.exists():
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "the export never uploaded a shard"
        time.sleep(0.1)
    process.send_signal(stop_with)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    return stderr


@pytest.mark.slow  # exports killed and terminated
def test_killed_export_is_refused_and_overwritten_terminated_one_cleans_up(
        bucket, maxtext_uri, local_export, tmp_path):
    out = f"{bucket.root}/killed"
    export_cli(bucket, [maxtext_uri, "--out", out], tmp_path, signal.SIGKILL)
    assert MANIFEST not in objects(bucket, out) and INCOMPLETE in objects(bucket, out)
    assert_unfinished(out)
    result = export_cli(bucket, [maxtext_uri, "--out", out, "--overwrite"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert_same_export(objects(bucket, out), files(local_export), maxtext_uri)  # staging gone
    for name, content in objects(bucket, out).items():
        assert SENTINEL.encode() not in content, f"a credential written into {name}"
    assert SENTINEL not in result.stdout + result.stderr

    out = f"{bucket.root}/terminated"
    export_cli(bucket, [maxtext_uri, "--out", out], tmp_path, signal.SIGTERM)
    assert objects(bucket, out) == {}


def test_a_manifest_names_the_object_deleted_or_replaced(bucket, maxtext_uri, tmp_path):
    out = maxtext(maxtext_uri, QWEN3, f"{bucket.root}/damaged", max_shard_bytes=SHARD)
    listed = json.loads(objects(bucket, out)[MANIFEST])["files"]
    blob(bucket, f"{out}/model-00002-of-00005.safetensors").delete()
    blob(bucket, f"{out}/config.json").upload_from_string("{}")
    message = (f"{out}: an incomplete export: {out}/config.json has 2 bytes, {MANIFEST} lists "
               f"{listed['config.json']}; {out}/model-00002-of-00005.safetensors is missing "
               f"({MANIFEST} lists every file the export wrote)")
    for refuse in (lambda: check_export_complete(out, CheckpointError),
                   lambda: ObjectStorageCheckpoint(out, tmp_path)):
        with pytest.raises(CheckpointError) as error:
            refuse()
        assert str(error.value) == message
    # A local copy of an unfinished export is refused as well, before any header is read.
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / INCOMPLETE).write_text("{}")
    with pytest.raises(CheckpointError, match=f"copy: an unfinished export: {MANIFEST} is missing"):
        HfCheckpoint(tmp_path / "copy")


def test_overwrite_on_a_prefix(bucket, maxtext_uri, local_export):
    out = f"{bucket.root}/overwritten"
    blob(bucket, f"{out}/config.json").upload_from_string("{}")
    blob(bucket, f"{out}/sub/stale.safetensors").upload_from_string("old")
    with pytest.raises(CheckpointError, match="already holds objects \\(pass --overwrite"):
        maxtext(maxtext_uri, QWEN3, out)
    maxtext(maxtext_uri, QWEN3, out, overwrite=True, max_shard_bytes=SHARD)
    assert_same_export(objects(bucket, out), files(local_export), maxtext_uri)

    notes = f"{bucket.root}/not-a-checkpoint"
    blob(bucket, f"{notes}/notes.txt").upload_from_string("precious")
    with pytest.raises(CheckpointError, match=f"{notes} holds objects that do not look like a "
                       "checkpoint .* not replacing them, even with --overwrite"):
        maxtext(maxtext_uri, QWEN3, notes, overwrite=True)
    assert objects(bucket, notes) == {"notes.txt": b"precious"}
    with pytest.raises(CheckpointError, match="give a prefix inside the bucket"):
        maxtext(maxtext_uri, QWEN3, bucket.root, overwrite=True)


def test_inspect_gs_prints_hf_maxtext_and_tunix_tensors(bucket, maxtext_uri, capsys):
    out = maxtext(maxtext_uri, QWEN3, f"{bucket.root}/inspected", max_shard_bytes=SHARD)
    cli.main(["inspect", out])
    printed = capsys.readouterr().out
    assert f"{out}: HF safetensors — 5 safetensors file(s)" in printed
    assert "model.layers.1.mlp.down_proj.weight" in printed and "24 tensors" in printed
    cli.main(["inspect", maxtext_uri])
    printed = capsys.readouterr().out
    assert "MaxText — training state (params/params/...), unscanned, 2 layers" in printed
    assert "params/params/decoder/layers_1/mlp/wo/kernel" in printed
    assert f"item directory: {maxtext_uri}/checkpoints/1/items" in printed
    cli.main(["inspect", bucket.upload_tree(TUNIX / "lora_ckpt", "sources/inspect-lora")])
    assert "Tunix — qwen3, LoRA-only" in capsys.readouterr().out


def test_missing_bucket_prefix_and_object_are_named(bucket, maxtext_uri, tmp_path):
    with pytest.raises(CheckpointError, match="^gs://no-such-bucket/run: no such bucket "
                       "gs://no-such-bucket$"):
        maxtext("gs://no-such-bucket/run", QWEN3, tmp_path / "out")
    with pytest.raises(CheckpointError, match="^gs://no-such-bucket/out: no such bucket"):
        maxtext(maxtext_uri, QWEN3, "gs://no-such-bucket/out")
    with pytest.raises(CheckpointError, match=f"^{bucket.root}/nothing: no object under this "
                       "prefix$"):
        maxtext(f"{bucket.root}/nothing", QWEN3, tmp_path / "out")
    with pytest.raises(SystemExit, match=f"^tpu-models inspect: {bucket.root}/nothing: no "
                       "object under this prefix$"):
        cli.main(["inspect", f"{bucket.root}/nothing"])
    # A data object of the checkpoint gone: the read fails naming the item and the tensor.
    damaged = bucket.upload_tree(MAXTEXT, "sources/damaged")
    name, _, prefix = damaged.removeprefix("gs://").partition("/")
    for data in bucket.client.list_blobs(name, prefix=f"{prefix}/checkpoints/1/items/ocdbt"):
        if "/d/" in data.name:
            data.delete()
    out = f"{bucket.root}/from-damaged"
    with pytest.raises(CheckpointError, match=f"^{damaged}/checkpoints/1/items: cannot read "
                       "tensor"):
        maxtext(damaged, QWEN3, out)
    assert objects(bucket, out) == {}
    for uri in ("s3://b/x", "az://b/x"):
        with pytest.raises(CheckpointError, match="not supported yet"):
            maxtext(MAXTEXT, QWEN3, uri)
        with pytest.raises(CheckpointError, match="not supported yet"):
            maxtext(uri, QWEN3, tmp_path / "out")


@pytest.mark.e2e
def test_a_qwen3_export_cut_short_is_refused_by_tpu_models_serve_and_vllm_serve(
        bucket, local_export, tmp_path):
    """A plain Qwen3 export (tpu-inference's own class serves it, which never read the
    markers): killed before its manifest (the .incomplete marker and every other
    object), and with a shard of another size beside its manifest. `tpu-models serve`
    refuses both before vLLM starts, plain `vllm serve` when vLLM pulls its config
    (adapt/object_storage.py), each naming the prefix and the fault."""
    from tpu_models.harness.serve_process import PLAIN_VLLM, Server
    from tpu_models.loaders.export_marker import incomplete_marker, manifest

    exported = files(local_export)
    unfinished = bucket.upload(local_export, "cut/unfinished")
    blob(bucket, f"{unfinished}/{INCOMPLETE}").upload_from_string(
        json.dumps(incomplete_marker(None)))
    short = bucket.upload(local_export, "cut/short")
    shard = sorted(n for n in exported if n.endswith(".safetensors"))[1]
    blob(bucket, f"{short}/{MANIFEST}").upload_from_string(json.dumps(
        manifest({n: len(c) for n, c in exported.items()}, None, "2026-01-01T00:00:00+00:00")))
    blob(bucket, f"{short}/{shard}").upload_from_string(exported[shard][:-1000])
    reasons = {unfinished: f"{unfinished}: an unfinished export: {MANIFEST} is missing",
               short: f"{short}: an incomplete export: {short}/{shard} has "
                      f"{len(exported[shard]) - 1000} bytes, {MANIFEST} lists {len(exported[shard])}"}
    env = {**bucket.env, "VLLM_ASSETS_CACHE": str(tmp_path / "assets")}
    servers = {(uri, kind): Server(uri, "--max-model-len", "128", *args, env=env,
                                   log=tmp_path / f"{kind}-{i}.log", command=command)
               for i, uri in enumerate(reasons)
               for kind, command, args in (
                   ("tpu-models", None, ()),
                   ("vllm", PLAIN_VLLM, ("--load-format", "runai_streamer")))}
    for server in servers.values():
        server.launch()
    for (uri, kind), server in servers.items():
        assert server.wait_exit(180) != 0, (kind, uri)
        assert reasons[uri] in server.output(), (kind, server.tail())
        assert "Loading weights" not in server.output()
    tpu_models_line = servers[(unfinished, "tpu-models")].output().strip().splitlines()[-1]
    assert tpu_models_line.startswith(f"tpu-models serve: {reasons[unfinished]}")


def test_an_adapter_or_draft_export_cut_short_is_refused_naming_it(bucket, tmp_path):
    """--lora, --lora-modules and /v1/load_lora_adapter all read an adapter through
    LoraAdapter, and a gs:// draft is copied by local_draft: an export killed before
    its manifest is refused there, before a file is copied."""
    from tests.tiny import make_lora, make_qwen3
    from tpu_models.loaders.peft import LoraAdapter

    adapter = make_lora(make_qwen3(tmp_path / "base"), tmp_path / "adapter", r=4, seed=1)
    uri = bucket.upload(adapter, "cut/adapter")
    assert LoraAdapter(uri).rank == 4
    blob(bucket, f"{uri}/{INCOMPLETE}").upload_from_string("{}")
    with pytest.raises(CheckpointError) as error:
        LoraAdapter(uri)
    assert str(error.value).startswith(f"LoRA adapter {uri}: an unfinished export: {MANIFEST}")
    from tpu_models.loaders.object_storage import local_draft
    with pytest.raises(CheckpointError, match=f"^{uri}: an unfinished export"):
        local_draft(uri, lambda _: pytest.fail("copied"))
