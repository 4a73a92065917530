"""Checkpoints in object storage (gs://, s3://, az://), listed from their safetensors headers.

vLLM's `--load-format runai_streamer` pulls config.json and the tokenizer into a
local directory and streams the safetensors through Run:ai's model streamer.
Before that stream starts, `ObjectStorageCheckpoint` lists the same files and
reads each one's 8-byte length and header through the same streamer (its
client, credentials and emulator setting), so a checkpoint is checked against
its name/shape table as a local one is, with no weight read. The file sizes
are not known here: a file cut short fails in the stream instead.
"""

import json
from pathlib import Path, PurePosixPath

from tpu_models.loaders.hf import MAX_HEADER_BYTES, CheckpointError, TensorInfo, header_tensors

SCHEMES = ("gs://", "s3://", "az://")  # the streamer's, as vLLM's runai_utils lists them


def is_object_storage(uri: str) -> bool:
    return str(uri).lower().startswith(SCHEMES)


class ObjectStorageCheckpoint:
    """The safetensors files under `uri` and the tensors in them (as HfCheckpoint's)."""

    def __init__(self, uri: str, directory: str | Path):
        from runai_model_streamer import list_safetensors
        self.source = uri.rstrip("/")  # where the user put it: error messages name it
        self.directory = Path(directory)  # its config.json and tokenizer, pulled by vLLM
        self.files = sorted(list_safetensors(self.source))
        if not self.files:
            raise CheckpointError(f"{self.source}: no *.safetensors files")
        self.tensors: dict[str, TensorInfo] = {}
        for uri_of_file, header in zip(self.files, _read_headers(self.files)):
            file = PurePosixPath(uri_of_file.split("://", 1)[1])
            for info in header_tensors(file, header, None, where=uri_of_file):
                if info.name in self.tensors:
                    raise CheckpointError(
                        f"{info.name}: stored twice, in {self.tensors[info.name].file.name} "
                        f"and {file.name}")
                self.tensors[info.name] = info


def _read_headers(files: list[str]) -> list[dict]:
    """Each file's header as JSON: two small reads per file (its length, then the header)."""
    from runai_model_streamer import FileChunks, FileStreamer

    def read(requests: dict[int, tuple[int, int]]) -> dict[int, bytes]:
        with FileStreamer() as streamer:
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
            headers.append(json.loads(raws[i].decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: corrupted safetensors header: not valid JSON "
                                  f"({e})") from e
    return headers

