"""PEFT LoRA adapters, merged into the base weights as they stream in.

    W' = W + scale * B @ A,   scale = lora_alpha / r   (lora_alpha / sqrt(r) with use_rslora)

in fp32, cast back to the base tensor's dtype, so serving costs nothing per
token. An adapter is validated against the base checkpoint's name/shape table
before any weight is read: a mismatch stops loading with nothing half-merged.
"""

import json
import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tpu_models.loaders.export_marker import check_export_complete
from tpu_models.loaders.hf import CheckpointError
from tpu_models.loaders.tables import PROJECTIONS

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


class LoraAdapter:
    """A PEFT-format adapter: `LoraAdapter(dir)` reads adapter_config.json +
    adapter_model.safetensors; `LoraAdapter.from_tensors` takes them in memory
    (the Tunix exporter builds adapters that way)."""

    def __init__(self, directory: str | Path):
        from tpu_models.loaders.object_storage import is_object_storage, local_copy

        try:  # an adapter export cut short: refused before a file is read
            check_export_complete(directory, CheckpointError)
        except CheckpointError as e:  # its message starts with the adapter's path
            raise CheckpointError(f"LoRA adapter {e}") from None
        if is_object_storage(str(directory)):
            # Small enough to copy: read whole into memory, the copy removed at once.
            self.directory = str(directory).rstrip("/")  # what error messages name
            with local_copy(self.directory, (CONFIG, WEIGHTS, "adapter_model.bin")) as local:
                self._init(self._read_config(local), self._read_tensors(local))
            return
        self.directory = Path(directory)
        self._init(self._read_config(self.directory), self._read_tensors(self.directory))

    @classmethod
    def from_tensors(cls, config: dict, tensors: dict[str, torch.Tensor], where: str):
        adapter = cls.__new__(cls)
        adapter.directory = where
        adapter._init(adapter._checked(config), tensors)
        return adapter

    def _init(self, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.use_rslora = bool(config.get("use_rslora", False))
        self.alpha = float(config["lora_alpha"])
        # base tensor name -> (A [r, in], B [out, r])
        self.targets: dict[str, tuple[torch.Tensor, torch.Tensor]] = self._pair(tensors)

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"LoRA adapter {self.directory}: {what}")

    def _read_config(self, directory: Path) -> dict:
        path = directory / CONFIG
        if not path.exists():
            raise self._fail(f"no {CONFIG}")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise self._fail(f"{CONFIG} is not valid JSON ({e})") from e
        return self._checked(config)

    def _checked(self, config: dict) -> dict:
        unsupported = {
            "peft_type": config.get("peft_type", "LORA") != "LORA",
            "use_dora": bool(config.get("use_dora")),
            "bias": config.get("bias", "none") != "none",
            "modules_to_save": bool(config.get("modules_to_save")),
            "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
            "rank_pattern": bool(config.get("rank_pattern")),
            "alpha_pattern": bool(config.get("alpha_pattern")),
        }
        for field, bad in unsupported.items():
            if bad:
                raise self._fail(f"{field}={config.get(field)!r} is not supported (only plain "
                                 "LoRA on q/k/v/o/gate/up/down projections merges into the base)")
        for field in ("r", "lora_alpha"):
            if field not in config:
                raise self._fail(f"{CONFIG} has no {field!r}")
        return config

    def _read_tensors(self, directory: Path) -> dict[str, torch.Tensor]:
        path = directory / WEIGHTS
        if not path.exists():
            pickled = directory / "adapter_model.bin"
            hint = " (adapter_model.bin is pickle, which we never load)" if pickled.exists() else ""
            raise self._fail(f"no {WEIGHTS}{hint}")
        try:
            return load_file(path)
        except (SafetensorError, OSError) as e:
            raise self._fail(f"{WEIGHTS} is not a readable safetensors file ({e})") from e

    def _pair(self, tensors: dict[str, torch.Tensor]) -> dict:
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            match = _KEY.match(key)
            if match is None:
                raise self._fail(f"tensor {key} is not a LoRA A/B weight")
            module = match["module"]
            if module.split(".")[-1] not in PROJECTIONS:
                raise self._fail(f"tensor {key} targets {module}; supported targets: "
                                 f"{', '.join(PROJECTIONS)}")
            parts.setdefault(module, {})[match["part"]] = tensor
        if not parts:
            raise self._fail(f"{WEIGHTS} holds no LoRA weights")
        targets = {}
        for module, ab in parts.items():
            if set(ab) != {"A", "B"}:
                raise self._fail(f"{module} has lora_{''.join(ab)} but not both A and B")
            a, b = ab["A"], ab["B"]
            if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
                raise self._fail(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                                 "do not share a rank")
            if a.shape[0] != self.config["r"]:
                raise self._fail(f"{module}: rank {a.shape[0]} differs from r={self.config['r']}")
            targets[f"{module}.weight"] = (a, b)
        return targets

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def check_base(self, table: Mapping[str, tuple[int, ...]]) -> None:
        """Every target must be a base tensor of shape [out, in] matching B @ A."""
        for name, (a, b) in self.targets.items():
            if name not in table:
                raise self._fail(f"targets {name}, which the base checkpoint does not have "
                                 "(adapter trained for another model?)")
            want = tuple(table[name])
            if (b.shape[0], a.shape[1]) != want:
                raise self._fail(f"{name}: B @ A is [{b.shape[0]}, {a.shape[1]}] but the base "
                                 f"weight is {list(want)} (adapter trained for another model?)")

    def peft_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors under PEFT's names (adapter_model.safetensors)."""
        tensors = {}
        for name, (a, b) in sorted(self.targets.items()):
            module = name.removesuffix(".weight")
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        return tensors

    def save(self, out: str | Path, *, overwrite: bool = False) -> Path:
        """Writes the adapter in PEFT's format (atomically, one safetensors file)."""
        from tpu_models.loaders.exporter.hf_writer import HfWriter
        with HfWriter(out, overwrite=overwrite, weights_name="adapter_model",
                      max_shard_bytes=2**62) as writer:  # PEFT reads one file
            writer.add_all(self.peft_tensors().items())
            writer.write_json(CONFIG, self.config)
        return Path(out)

    def delta(self, name: str) -> torch.Tensor:
        a, b = self.targets[name]
        return self.scale * (b.float() @ a.float())

    def merge(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Streams (name, tensor), adding the adapter's delta to its targets."""
        merged = set()
        for name, tensor in tensors:
            if name in self.targets:
                tensor = (tensor.float() + self.delta(name)).to(tensor.dtype)
                merged.add(name)
            yield name, tensor
        if missed := set(self.targets) - merged:
            raise self._fail(f"targets never seen in the base checkpoint: {sorted(missed)}")
