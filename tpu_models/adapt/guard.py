"""How an adaptation changes tpu-inference or vLLM: named, guarded, failing closed.

Each `Patch` names the attributes it replaces (`Target`: a dotted path and the
parameters it must still take), why, where it applies, the serving feature it
belongs to and the test that fails without it. Before a feature's patches are
installed, every target of every one of them is checked; if one is missing or
takes other parameters, none is installed and the feature is refused: a model
that would use it stops at start-up (`require`) naming the feature and the
tpu-inference version, rather than being served wrong. The ledger
(docs/adaptations.md) is written from these records.

Standard library only at import: the decoder imports `require`.
"""

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Callable

# The tpu-inference release these adaptations were written against.
WRITTEN_FOR = "0.32.0"
OFF_TPU, EVERYWHERE = "off-TPU", "every platform"
# Installed only in `tpu-models compile`'s process (tpu_models.host.compile_target).
COMPILING = "compiling for a TPU"


class AdaptationError(RuntimeError):
    """A feature the engine was asked for cannot be adapted to this tpu-inference."""


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    # (vllm_config, our model class) -> whether this engine needs the feature
    in_use: Callable[[object, type], bool]
    instead: str  # what a user can do while it is refused


def _compiling() -> bool:
    from tpu_models.host import compile_target
    return compile_target() is not None


def _attention_mode() -> str:
    from tpu_models.host import attention_mode
    return attention_mode()


def _speculating(vllm_config, _model) -> bool:
    return vllm_config.speculative_config is not None


def _eagle3(vllm_config, _model) -> bool:
    spec = vllm_config.speculative_config
    return spec is not None and spec.method in ("eagle3", "eagle")


def _sliding(vllm_config, model) -> bool:
    return (not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager and any(
        w is not None for w in model.sliding_windows(vllm_config.model_config.hf_text_config)))


OFF_TPU_HOST = Feature("serving off-TPU", lambda *_: host_platform_set(),
                       "run on a TPU host, or install tpu-inference==" + WRITTEN_FOR)
LORA = Feature("per-request LoRA adapters (--enable-lora)",
               lambda c, _: c.lora_config is not None,
               "merge one adapter at load (tpu-models serve --lora)")
HYBRID_KV = Feature("the hybrid KV cache for sliding-window layers", _sliding,
                    "pass --disable-hybrid-kv-cache-manager")
EAGLE3 = Feature("EAGLE-3 drafts", _eagle3, "serve without --speculative-config, or with n-gram")
GUIDED = Feature("guided decoding (response_format, structured outputs)", lambda *_: True,
                 "install tpu-inference==" + WRITTEN_FOR)
GUIDED_WITH_DRAFTS = Feature("guided decoding beside speculative drafts", _speculating,
                             "serve without --speculative-config")
IN_PROCESS = Feature("vllm.LLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
                     lambda *_: os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
                     "run the engine in its own process (vLLM's default)")
SAMPLING_CHECKS = Feature("sampling parameters refused rather than ignored", lambda *_: True,
                          "install tpu-inference==" + WRITTEN_FOR)
# Refused, these requests get a 400 instead (adapt.sampling).
LOGPROBS_ZERO = Feature("logprobs=0", lambda *_: False, "")
LOGPROBS_WITH_DRAFTS = Feature("logprobs beside speculative drafts", lambda *_: False, "")
SAMPLER_EXTRAS = Feature("min_p, seeds, logit_bias, allowed_token_ids, min_tokens, penalties "
                         "and bad_words",
                         lambda *_: False, "")
RPA_PATH = Feature("the TPU attention path off-TPU (TPU_MODELS_ATTENTION=rpa-reference, "
                   "rpa-interpret)",
                   lambda *_: _attention_mode() in ("rpa-reference", "rpa-interpret"),
                   "TPU_MODELS_ATTENTION=portable")
RPA_INTERPRET = Feature("the Pallas kernel interpreted off-TPU (TPU_MODELS_ATTENTION=rpa-interpret)",
                        lambda *_: _attention_mode() == "rpa-interpret",
                        "TPU_MODELS_ATTENTION=rpa-reference")
# Speed only: refused, the server starts slower and nothing else.
STARTUP = Feature("a fast start (the step compiled ahead of time, buckets in the background)",
                  lambda *_: False, "")
# Speed only: refused, an EAGLE-3 step launches tpu-inference's programs one by one.
SPEC_FUSION = Feature("EAGLE-3 verification and drafting in one program per step",
                      lambda *_: False, "")
EXPORT_MARKERS = Feature("exports cut short refused on every serve path", lambda *_: True,
                         "check with tpu-models inspect before serving")
KV_BUDGET = Feature("--kv-cache-memory-bytes on a TPU",
                    lambda c, _: bool(c.cache_config.kv_cache_memory_bytes),
                    "size the cache with --gpu-memory-utilization")
COMPILE_ONLY = Feature("compiling for a TPU topology (tpu-models compile)",
                       lambda *_: _compiling(), "install tpu-inference==" + WRITTEN_FOR)
TUNIX_ROLLOUTS = Feature("Tunix's vLLM rollouts on our models (tpu_models.tunix)", lambda *_: False,
                         "google-tunix==0.1.5's rollout_engine='vanilla'")
# Memory only: refused, log-probs take upstream's whole-vocabulary temporaries.
LOGPROBS_IN_PIECES = Feature("log-probs a piece of rows at a time", lambda *_: False, "")
# Messages only: refused, a start-up mistake is named by vLLM's own error.
START_CHECKS = Feature("start-up mistakes named in one line", lambda *_: False, "")
# Log accuracy only: refused, the log line is wrong and nothing else.
LOG = Feature("a truthful weight-loading time in the log", lambda *_: False, "")


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
        """Puts `by` at `path`, the original kept for it (`original`); a module's
        function also where tpu_inference modules imported it by name."""
        if self.path in ORIGINALS:  # installed already
            return
        owner_path, name = self.path.rsplit(".", 1)
        try:
            owner = importlib.import_module(owner_path)
        except ImportError:  # a class
            owner = Target(owner_path, "").resolve()
        raw = inspect.getattr_static(owner, name)
        ORIGINALS[self.path] = raw.__func__ if isinstance(raw, classmethod) else getattr(owner, name)
        replacement = _calling_original(self.by, ORIGINALS[self.path])
        if isinstance(raw, (staticmethod, classmethod)):
            replacement = type(raw)(replacement)
        if inspect.ismodule(owner):
            rebind(owner.__name__, name, replacement)
        setattr(owner, name, replacement)


# Target path -> what was there before the seam replaced it.
ORIGINALS: dict[str, Callable] = {}


def _calling_original(by: Callable, original: Callable) -> Callable:
    """`by`, handed the original as its first argument."""
    @functools.wraps(by)
    def replaced(*args, **kwargs):
        return by(original, *args, **kwargs)
    return replaced


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    feature: Feature
    targets: tuple[Target, ...]
    why: str  # one line: what goes wrong without it
    test: str  # tests/FILE.py::TEST: fails without it, or (speed) checks its output
    # What the patch does beyond replacing its targets' `by` (None: nothing).
    install: Callable[[], None] | None = None
    platform: str = EVERYWHERE
    upstream: str = "none filed"
    speed: str = ""  # for a speed-only patch, the benchmark that shows it


def host_platform_set() -> bool:
    from tpu_models.host import host_platform
    return host_platform() is not None


def platforms_here() -> set[str]:
    """The `Patch.platform` values that apply in this process."""
    from tpu_models.host import compile_target
    if compile_target():
        return {EVERYWHERE, COMPILING}
    return {EVERYWHERE, OFF_TPU} if host_platform_set() else {EVERYWHERE}


def upstream_version() -> str:
    return importlib.metadata.version("tpu-inference")


# Feature name -> why it is refused in this process (filled by `install`).
_refused: dict[str, str] = {}


def refused() -> dict[str, str]:
    return dict(_refused)


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
        _refused[name] = reason
        log.warning("tpu-models: %s", reason)
    if version != WRITTEN_FOR:
        log.warning("tpu-models: tpu-inference %s, adaptations written for %s: %d of %d "
                    "features apply", version, WRITTEN_FOR, len(by_feature) - len(_refused),
                    len(by_feature))


def require(vllm_config, model_class: type) -> None:
    """At model build: refuses the features this engine needs but cannot have."""
    for feature in FEATURES:
        if feature.name in _refused and feature.in_use(vllm_config, model_class):
            instead = f". Instead: {feature.instead}" if feature.instead else ""
            raise AdaptationError(f"tpu-models: {_refused[feature.name]}{instead}")


def our_model(vllm_config) -> type | None:
    """The tpu_models class the engine runs on the flax_nnx path, else None."""
    if vllm_config.compilation_config.static_forward_context:
        return None  # vLLM's PyTorch model (MODEL_IMPL_TYPE=vllm): its layers declare themselves
    from tpu_inference.models.common.model_loader import _MODEL_REGISTRY

    from tpu_models import registry
    ours = {a.hf_name for a in registry.architectures() if a.model is not None}
    for name in vllm_config.model_config.architectures or ():
        model_class = _MODEL_REGISTRY.get(name)
        if name in ours and isinstance(model_class, type):
            return model_class
    return None


def rebind(module_name: str, name: str, replacement) -> None:
    """Replaces module_name.name in every tpu_inference module that imported it by name."""
    original = getattr(importlib.import_module(module_name), name)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("tpu_inference") and getattr(mod, name, None) is original:
            setattr(mod, name, replacement)


FEATURES = (OFF_TPU_HOST, LORA, HYBRID_KV, EAGLE3, GUIDED, GUIDED_WITH_DRAFTS, SAMPLING_CHECKS,
            LOGPROBS_ZERO, LOGPROBS_WITH_DRAFTS, SAMPLER_EXTRAS, IN_PROCESS, RPA_PATH,
            RPA_INTERPRET, STARTUP, SPEC_FUSION, EXPORT_MARKERS, KV_BUDGET, COMPILE_ONLY,
            TUNIX_ROLLOUTS, LOGPROBS_IN_PIECES, START_CHECKS, LOG)
