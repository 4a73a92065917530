"""The serving features that need tpu-inference or vLLM adapted (tpu_models.adapt), when
an engine uses each, and what a user can do while one is refused.

The seam installs a feature's patches all or none (tpu_models.patching); a feature whose
patches cannot apply on this tpu-inference is refused (`refuse`), and a model that
would use it stops at build (`require`) naming the feature and the version, rather
than being served wrong.

Standard library only at import: the plugin hands `require` to the models' builds.
"""

import dataclasses
import os
from collections.abc import Callable

# The tpu-inference release the adaptations were written against.
WRITTEN_FOR = "0.32.0"


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


ACROSS_HOSTS = Feature(
    "serving across hosts (TPU_MULTIHOST_BACKEND=ray; tpu-models serve --local-hosts)",
    lambda *_: _across_hosts(), "serve on one host")


def _across_hosts() -> bool:
    from tpu_models.multihost import serving_across_hosts
    return serving_across_hosts()


def host_platform_set() -> bool:
    from tpu_models.host import host_platform
    return host_platform() is not None


# Feature name -> why it is refused in this process (the guard `refuse`s it).
_refused: dict[str, str] = {}


def refused() -> dict[str, str]:
    return dict(_refused)


def refuse(feature: Feature, reason: str) -> None:
    _refused[feature.name] = reason


def require(vllm_config, model_class: type) -> None:
    """At model build: refuses the features this engine needs but cannot have."""
    for feature in FEATURES:
        if feature.name in _refused and feature.in_use(vllm_config, model_class):
            instead = f". Instead: {feature.instead}" if feature.instead else ""
            raise AdaptationError(f"tpu-models: {_refused[feature.name]}{instead}")


FEATURES = (OFF_TPU_HOST, LORA, HYBRID_KV, EAGLE3, GUIDED, GUIDED_WITH_DRAFTS, SAMPLING_CHECKS,
            LOGPROBS_ZERO, LOGPROBS_WITH_DRAFTS, SAMPLER_EXTRAS, IN_PROCESS, RPA_PATH,
            RPA_INTERPRET, STARTUP, SPEC_FUSION, EXPORT_MARKERS, KV_BUDGET, COMPILE_ONLY,
            TUNIX_ROLLOUTS, LOGPROBS_IN_PIECES, START_CHECKS, LOG, ACROSS_HOSTS)
