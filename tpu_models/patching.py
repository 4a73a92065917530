"""Guarded patching: how the seam (tpu_models.adapt) changes tpu-inference and vLLM,
named, guarded, failing closed; and the ledger written from it.

Each `Patch` names the attributes it replaces (`Target`: a dotted path and the
parameters it must still take), why, where it applies, the serving feature it
belongs to (tpu_models.features) and the test that fails without it. Before a
feature's patches are installed, every target of every one of them is checked; if
one is missing or takes other parameters, none is installed and the feature is
refused (features.require then stops a model that would use it). The ledger
(docs/adaptations.md) is written from these records (`ledger`).
"""

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence

from tpu_models import features
from tpu_models.features import (COMPILE_ONLY, OFF_TPU_HOST, WRITTEN_FOR, AdaptationError,
                                 host_platform_set)

OFF_TPU, EVERYWHERE = "off-TPU", "every platform"
# Installed only in `tpu-models compile`'s process (tpu_models.host.compile_target).
COMPILING = "compiling for a TPU"


@dataclasses.dataclass(frozen=True)
class Target:
    path: str  # "package.module.Class.attr" or "package.module.attr"
    params: str  # the parameter names it must take, space-separated (its shape)
    # Our replacement, installed by the patch: called with the original first, then
    # the target's own arguments. None: the patch's `install` changes the target.
    by: Callable | None = None

    def resolve(self):
        """The object at `path`, or raises LookupError."""
        parts = self.path.split(".")
        for split in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            for name in parts[split:]:
                if not hasattr(obj, name):
                    raise LookupError(f"{self.path}: no attribute {name!r}")
                obj = getattr(obj, name)
            return obj
        raise LookupError(f"{self.path}: no such module")

    def problem(self) -> str | None:
        try:
            obj = self.resolve()
        except LookupError as e:
            return str(e)
        try:
            params = " ".join(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            return f"{self.path}: not a callable"
        if params != self.params:
            return f"{self.path} takes ({params}), expected ({self.params})"
        return None

    def replace(self) -> None:
        """Puts `by` at `path`, handed what was there; a module's function also where
        tpu_inference modules imported it by name. A later patch's replacement of the
        same target wraps the earlier one's (the order installed: adapt.MODULES)."""
        if self.by in INSTALLED.get(self.path, ()):  # installed already
            return
        owner_path, name = self.path.rsplit(".", 1)
        try:
            owner = importlib.import_module(owner_path)
        except ImportError:  # a class
            owner = Target(owner_path, "").resolve()
        raw = inspect.getattr_static(owner, name)
        current = raw.__func__ if isinstance(raw, classmethod) else getattr(owner, name)
        ORIGINALS.setdefault(self.path, current)
        INSTALLED.setdefault(self.path, []).append(self.by)
        replacement = _calling_original(self.by, current)
        if isinstance(raw, (staticmethod, classmethod)):
            replacement = type(raw)(replacement)
        if inspect.ismodule(owner):
            rebind(owner.__name__, name, replacement)
        setattr(owner, name, replacement)


# Target path -> upstream's, before the seam replaced it; and our replacements there.
ORIGINALS: dict[str, Callable] = {}
INSTALLED: dict[str, list[Callable]] = {}


def _calling_original(by: Callable, original: Callable) -> Callable:
    """`by`, handed the original as its first argument."""
    @functools.wraps(by)
    def replaced(*args, **kwargs):
        return by(original, *args, **kwargs)
    return replaced


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    feature: features.Feature
    targets: tuple[Target, ...]
    why: str  # one line: what goes wrong without it
    test: str  # tests/FILE.py::TEST: fails without it, or (speed) checks its output
    # What the patch does beyond replacing its targets' `by` (None: nothing).
    install: Callable[[], None] | None = None
    platform: str = EVERYWHERE
    upstream: str = "none filed"
    speed: str = ""  # for a speed-only patch, the benchmark that shows it


def platforms_here() -> set[str]:
    """The `Patch.platform` values that apply in this process."""
    from tpu_models.host import compile_target
    if compile_target():
        return {EVERYWHERE, COMPILING}
    return {EVERYWHERE, OFF_TPU} if host_platform_set() else {EVERYWHERE}


def upstream_version() -> str:
    return importlib.metadata.version("tpu-inference")


def assess(patches: list[Patch]) -> dict[str, tuple[list[Patch], list[str]]]:
    """feature name -> (its patches that apply on this host, what stops them)."""
    here = platforms_here()
    by_feature: dict[str, list[Patch]] = {}
    for patch in patches:
        if patch.platform in here:
            by_feature.setdefault(patch.feature.name, []).append(patch)
    return {name: (group, [f"{p.name}: {problem}" for p in group for t in p.targets
                           if (problem := t.problem())])
            for name, group in by_feature.items()}


def install(patches: list[Patch], log) -> None:
    """Installs the patches that apply on this host, a feature's all or none."""
    version = upstream_version()
    by_feature = assess(patches)
    for name, (group, problems) in by_feature.items():
        if not problems:
            for patch in group:
                for target in patch.targets:
                    if target.by is not None:
                        target.replace()
                if patch.install is not None:
                    patch.install()
            continue
        where = (f"on tpu-inference {version}" if version == WRITTEN_FOR else
                 f"tpu-models adapts tpu-inference {WRITTEN_FOR}, this is {version}, and")
        reason = f"{name} is not available: {where} {'; '.join(problems)}"
        if group[0].feature in (OFF_TPU_HOST, COMPILE_ONLY):
            raise AdaptationError(f"tpu-models: {reason}. Run on a TPU host or install "
                                  f"tpu-inference=={WRITTEN_FOR}.")
        features.refuse(group[0].feature, reason)
        log.warning("tpu-models: %s", reason)
    if version != WRITTEN_FOR:
        log.warning("tpu-models: tpu-inference %s, adaptations written for %s: %d of %d "
                    "features apply", version, WRITTEN_FOR,
                    len(by_feature) - len(features.refused()), len(by_feature))


def rebind(module_name: str, name: str, replacement) -> None:
    """Replaces module_name.name in every tpu_inference module that imported it by name."""
    original = getattr(importlib.import_module(module_name), name)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("tpu_inference") and getattr(mod, name, None) is original:
            setattr(mod, name, replacement)


def replace_model_validator(model_class, name: str, by: Callable) -> None:
    """Pydantic model `model_class`'s validator `name` replaced by `by`, handed the
    original first. Pydantic compiled the validators: ours put in place, the class rebuilt."""
    validators = model_class.__pydantic_decorators__.model_validators
    decorator = validators[name]
    checked = functools.partial(by, decorator.func)
    validators[name] = dataclasses.replace(decorator, func=checked)
    model_class.model_rebuild(force=True)


def ledger(package: str, modules: Sequence[str], on_import: Mapping[str, str]) -> str:
    """The ledger of a seam package's patches, a section per module (in `modules`'
    order, then those installed on import): what it changes upstream, and what to
    drop when upstream fixes it."""
    folder = package.replace(".", "/")
    lines = [
        "# Adaptations of tpu-inference and vLLM",
        "",
        f"Written against tpu-inference {WRITTEN_FOR}. Generated by "
        f"`python -m {package}` from `{folder}/` (a test keeps it in step).",
        "Each patch checks that its targets still take the parameters listed; on another "
        "version a feature whose patch cannot apply is refused at start-up, naming it.",
        "",
    ]
    for name in (*modules, *on_import):
        module = importlib.import_module(f"{package}.{name}")
        installed = f" Installed by `import {on_import[name]}`." if name in on_import else ""
        lines += [f"## {name} (`{folder}/{name}.py`)", "",
                  module.__doc__.strip().splitlines()[0] + installed, "",
                  "| patch | targets (parameters) | why | platform | feature refused without it "
                  "| upstream | test that fails without it |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for p in module.PATCHES:
            targets = "<br>".join(f"`{t.path}` ({t.params})" for t in p.targets) or "environment"
            test = (f"none, speed only (`{p.speed}`); output checked by `{p.test}`" if p.speed
                    else f"`{p.test}`")
            lines.append(f"| {p.name} | {targets} | {p.why} | {p.platform} | {p.feature.name} "
                         f"| {p.upstream} | {test} |")
        lines.append("")
    return "\n".join(lines)
