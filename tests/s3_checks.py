"""`python -m tests.s3_checks S3_URI CHECKPOINT_DIR`: an HF checkpoint uploaded to S3
(moto on loopback, AWS_* settings in the environment) read back through the loader:
run by tests/test_object_storage.py in a process of its own."""

import sys
from pathlib import Path

import numpy as np


def main(uri: str, checkpoint: Path) -> None:
    import boto3
    import pytest

    from tpu_models import host
    host.setup_host("cpu")
    from safetensors.numpy import load_file
    from vllm.model_executor.model_loader.weight_utils import runai_safetensors_weights_iterator

    from tpu_models.loaders.hf import CheckpointError, HfCheckpoint
    from tpu_models.loaders.object_storage import ObjectStorageCheckpoint
    from tpu_models.loaders.object_storage import checked_stream

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    client = boto3.client("s3")

    def upload(file: Path) -> None:
        client.upload_file(str(file), bucket, f"{prefix}/{file.name}")

    remote = ObjectStorageCheckpoint(uri, checkpoint)
    assert ({n: (i.shape, i.dtype, i.file.name) for n, i in remote.tensors.items()} ==
            {n: (i.shape, i.dtype, i.file.name) for n, i in HfCheckpoint(checkpoint).tensors.items()})
    local = {n: t for f in sorted(checkpoint.glob("*.safetensors")) for n, t in load_file(f).items()}
    streamed = dict(checked_stream(runai_safetensors_weights_iterator(remote.files, False), remote))
    assert streamed.keys() == local.keys()
    for name, tensor in streamed.items():
        np.testing.assert_array_equal(tensor.numpy(), local[name], err_msg=name)

    stream = checked_stream(runai_safetensors_weights_iterator(remote.files, False), remote)
    next(stream)
    shard = checkpoint / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-4] + b"\0\0\0\1")  # same size, new content: a new ETag
    upload(shard)
    with pytest.raises(CheckpointError, match=rf"{uri}/{shard.name}: replaced while"):
        list(stream)
    shard.write_bytes(data[:-1000])
    upload(shard)
    with pytest.raises(CheckpointError, match=rf"{uri}/{shard.name}: truncated"):
        ObjectStorageCheckpoint(uri, checkpoint)
    print("all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
