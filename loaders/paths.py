"""MODEL as given on a command line: what is wrong with it, before anything loads."""

from pathlib import Path

from tpu_models.loaders.object_storage import is_object_storage


def model_path_problem(model: str, dummy_weights: bool) -> str | None:
    """What is wrong with MODEL as a checkpoint directory on this machine, in one line
    naming it, else None (object storage and Hugging Face repository ids pass)."""
    if is_object_storage(model):
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        if dummy_weights or any(path.glob("*.safetensors")):
            return None
        what = ("only pickle weights (*.bin), which tpu-models never loads"
                if any(path.glob("*.bin")) else "no *.safetensors weights")
        return (f"{model}: {what}. A directory of config.json and a tokenizer serves random "
                "weights with --load-format dummy, and `tpu-models compile` takes it as it is")
    if path.exists():
        return f"{model}: not a directory (MODEL is a checkpoint directory)"
    if model.startswith(("/", ".", "~")) or model.count("/") != 1:
        return (f"{model}: no such directory (MODEL is a checkpoint directory, a gs:// or "
                "s3:// prefix, or a Hugging Face repository id)")
    return None

