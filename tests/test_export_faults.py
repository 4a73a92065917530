"""Exporter faults: a killed export leaves nothing that looks complete, an
existing output is refused unless --overwrite (and then replaced in one
rename), and names from checkpoint metadata cannot reach outside the
directories they belong to."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tpu_models.loaders.exporter import hf_writer
from tpu_models.loaders.exporter.convert import lora_merge, maxtext
from tpu_models.loaders.hf import CheckpointError, HfCheckpoint
from tpu_models.loaders.exporter.hf_writer import HfWriter, check_out
from tpu_models import registry

QWEN3 = registry.by_hf_name("Qwen3ForCausalLM")

ROOT = Path(__file__).parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "maxtext" / "qwen3_unscanned"

# `tpu-models export`, stopped at a chosen point of HfWriter (to be killed there):
# "_flush" once one shard is on disk, "_move_into_place" with every file written.
STOPPED_CLI = """
import os, sys, time
from tpu_models.loaders.exporter import hf_writer
stage, signal_file = os.environ["STOP_AT"], os.environ["STOP_SIGNAL"]
original, calls = getattr(hf_writer.HfWriter, stage), []
def stop(self, *args, **kwargs):
    calls.append(1)
    if stage != "_flush" or len(calls) == 2:
        with open(signal_file, "w") as f:
            f.write(str(self.tmp))
        time.sleep(600)
    return original(self, *args, **kwargs)
setattr(hf_writer.HfWriter, stage, stop)
from tpu_models.server.cli import main
main(sys.argv[1:])
"""


def export_args(out: Path, *extra: str) -> list[str]:
    return ["export", "maxtext", str(FIXTURE), "--model", "qwen3", "--out", str(out),
            "--max-shard-size", "40000", *extra]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpu_models.server.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ,
                                                                 "JAX_PLATFORMS": "cpu"})


def stop_and_kill(args: list[str], stage: str, sig: int, tmp_path: Path) -> tuple[Path, str]:
    """Runs the export CLI until `stage`, sends `sig`; returns (temporary dir, stderr)."""
    signal_file = tmp_path / "stopped"
    process = subprocess.Popen(
        [sys.executable, "-c", STOPPED_CLI, *args], cwd=ROOT, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "STOP_AT": stage,
             "STOP_SIGNAL": str(signal_file)})
    deadline = time.monotonic() + 240
    while not signal_file.exists():
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "export never reached " + stage
        time.sleep(0.1)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    return Path(signal_file.read_text()), stderr


def partials(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if ".partial-" in p.name)


def test_export_killed_while_writing_shards_leaves_only_a_partial_dir(tmp_path):
    out = tmp_path / "out"
    tmp, _ = stop_and_kill(export_args(out), "_flush", signal.SIGKILL, tmp_path)
    assert not out.exists()
    assert partials(tmp_path) == [tmp]
    assert tmp.name.startswith(".out.partial-") and (tmp / "shard-00000.safetensors").exists()
    assert not (tmp / "config.json").exists()


@pytest.mark.slow  # an export killed, then run again
def test_export_killed_before_the_rename_keeps_the_old_output_and_is_cleaned_next_run(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"old": true}')  # an earlier export, to be replaced
    tmp, _ = stop_and_kill(export_args(out, "--overwrite"), "_move_into_place", signal.SIGKILL,
                           tmp_path)
    # Everything was written, complete-looking, but only under the partial name:
    assert (tmp / "config.json").exists() and (tmp / "model.safetensors.index.json").exists()
    HfCheckpoint(tmp)
    assert json.loads((out / "config.json").read_text()) == {"old": True}
    assert [p.name for p in out.iterdir()] == ["config.json"]

    result = cli(*export_args(out, "--overwrite"))
    assert result.returncode == 0, result.stderr
    assert partials(tmp_path) == []  # the killed run's directory is gone
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    HfCheckpoint(out)
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~current_umask())


def test_export_terminated_cleans_up_after_itself(tmp_path):
    out = tmp_path / "out"
    _, stderr = stop_and_kill(export_args(out), "_flush", signal.SIGTERM, tmp_path)
    assert not out.exists()
    assert partials(tmp_path) == []


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_existing_output_is_refused_naming_it_unless_overwrite(tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "config.json").write_text("{}")
    result = cli(*export_args(out))
    assert result.returncode != 0
    assert f"tpu-models export: {out} already exists (pass --overwrite to replace it)" \
        in result.stderr
    assert [p.name for p in out.iterdir()] == ["config.json"]


def test_overwrite_that_fails_leaves_the_old_output_intact(tmp_path):
    run = shutil.copytree(FIXTURE, tmp_path / "run")
    for data in (run / "checkpoints").rglob("d/*"):
        data.write_bytes(data.read_bytes()[:16])  # fails reading, inside the writer
    out = tmp_path / "out"
    maxtext(FIXTURE, QWEN3, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(CheckpointError, match="cannot read"):
        maxtext(run, QWEN3, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert partials(tmp_path) == []


@pytest.mark.parametrize("atomic", [True, False])
def test_overwrite_replaces_the_whole_directory(atomic, tmp_path, monkeypatch):
    if not atomic:  # file systems without RENAME_EXCHANGE: two renames
        monkeypatch.setattr(hf_writer, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    (out / "stale.txt").write_text("from the old export")
    with HfWriter(out, overwrite=True) as writer:
        writer.add("w", np.ones(3, np.float32))
        writer.write_json("config.json", {"new": True})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_refuses_what_is_not_a_checkpoint(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError, match=f"{home} exists and does not look like a checkpoint "
                       "\\(no config.json, adapter_config.json or \\*.safetensors\\); not "
                       "replacing it, even with --overwrite"):
        check_out(home, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        check_out(tmp_path / "file", overwrite=True)
    (tmp_path / "empty").mkdir()
    check_out(tmp_path / "empty", overwrite=True)


def test_stale_partials_of_live_processes_and_other_outputs_are_kept(tmp_path):
    import socket
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    names = [f".out.partial-{dead}@{host}-abc", f".out.partial-{os.getpid()}@{host}-def",
             f".out.partial-{dead}@another-host-ghi", f".other.partial-{dead}@{host}-jkl"]
    for name in names:
        (tmp_path / name).mkdir()
    with HfWriter(tmp_path / "out") as writer:
        writer.add("w", np.ones(2, np.float32))
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["out", *names[1:]])


@pytest.mark.parametrize("name", ["../evil.json", "/tmp/evil.json", "sub/config.json", "..", ""])
def test_writer_only_writes_plain_names_inside_the_output(name, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="not a plain file name"):
        with HfWriter(out) as writer:
            writer.write_json(name, {})
    with pytest.raises(CheckpointError, match="not a plain file name"):
        with HfWriter(out) as writer:
            writer.copy_file(__file__, name or ".")
    with pytest.raises(CheckpointError, match="not a plain file name"):
        HfWriter(out, weights_name=name or "/")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing, not even a partial dir


def test_tensor_names_are_keys_never_paths(tmp_path):
    out = tmp_path / "a" / "out"
    with HfWriter(out) as writer:
        writer.add("../../escape", np.ones(2, np.float32))
        writer.add("/etc/passwd", np.ones(2, np.float32))
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "model.safetensors", "out"]
    assert set(HfCheckpoint(out).tensors) == {"../../escape", "/etc/passwd"}


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/ABS/outside.safetensors",
                                   "sub/../../outside.safetensors", "..\\outside.safetensors"])
def test_index_entries_cannot_leave_the_checkpoint(entry, tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "outside.safetensors")
    base = tmp_path / "base"
    base.mkdir()
    entry = entry.replace("/ABS", str(tmp_path))
    (base / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": entry}}))
    with pytest.raises(CheckpointError, match=re.escape(
            f"model.safetensors.index.json: weight_map entry {entry!r} lies outside {base}")):
        HfCheckpoint(base)


def test_lora_merge_refuses_a_base_whose_index_leaves_it(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    save_file({"a": torch.zeros(2)}, tmp_path / "outside.safetensors")
    (base / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 4,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}))
    (base / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match="lies outside"):
        lora_merge(base, tmp_path / "adapter", tmp_path / "out", arch=QWEN3)
    assert not (tmp_path / "out").exists() and partials(tmp_path) == []


def test_symlinked_shards_inside_the_checkpoint_still_load(tmp_path):
    """HF hub snapshots link each file into a blob store outside the snapshot."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    save_file({"a": torch.zeros(2)}, blobs / "1234abcd")
    (snapshot / "model-00001-of-00001.safetensors").symlink_to(blobs / "1234abcd")
    (snapshot / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    assert set(HfCheckpoint(snapshot).tensors) == {"a"}


def test_a_tensor_off_the_plan_is_refused_and_nothing_is_written(tmp_path):
    """An exporter that planned its sizes (for gs://: shards under their final names)
    and then writes something else is a bug: refused by name, no directory left."""
    planned = [("a", 12), ("b", 8)]
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="tensor b \\(12 bytes\\) written where the export "
                       "planned b of 8 bytes"):
        with HfWriter(out, planned=planned) as writer:
            writer.add("a", np.ones(3, np.float32))
            writer.add("b", np.ones(3, np.float32))
    with pytest.raises(CheckpointError, match="tensor b was planned but never written"):
        with HfWriter(out, planned=planned) as writer:
            writer.add("a", np.ones(3, np.float32))
    assert list(tmp_path.iterdir()) == []


def test_shard_count_follows_the_writer(tmp_path):
    """shard_count (what a planned gs:// export names its shards by) against the shards
    HfWriter writes: a tensor larger than a shard gets its own; zero-size tensors too."""
    rng = np.random.default_rng(0)
    for trial in range(60):
        sizes = [int(s) for s in rng.choice([0, 4, 40, 96, 100, 400], rng.integers(0, 12))]
        with HfWriter(tmp_path / str(trial), max_shard_bytes=100) as writer:
            for i, size in enumerate(sizes):
                writer.add(f"t{i}", np.zeros(size // 4, np.float32))
        written = len(list((tmp_path / str(trial)).glob("*.safetensors")))
        assert hf_writer.shard_count(sizes, 100) == written, sizes
