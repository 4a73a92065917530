"""The seam with tpu-inference and vLLM: every change we make to them, by subsystem.

tpu-inference's extension points are used where they exist (register_model,
register_attention_backend: tpu_models.plugin; additional_config: runtime).
Everything else is a patch, one module per upstream subsystem, each listing its
`PATCHES` (tpu_models.patching.Patch: targets, why, platform, feature, test).
`apply` installs them in every vLLM process through the plugin; a feature whose
targets changed is refused, not served wrong (patching.install).
docs/adaptations.md is the ledger, written by `python -m tpu_models.adapt`.
"""

import importlib
import os

from tpu_models import features, patching

# Upstream subsystems, in the order their patches are installed.
MODULES = ("topology", "host_portability", "rpa_kernel", "engine", "multihost", "object_storage",
           "loading", "compilation", "kv_cache", "lora", "speculative", "structured_output",
           "sampling", "logprobs", "spec_fusion", "request_checks")
# Installed by the module that needs them, not in every vLLM process (the ledger lists them).
ON_IMPORT = {"tunix_rollout": "tpu_models.tunix"}
_applied = False


def patches() -> list[patching.Patch]:
    return [patch for name in MODULES
            for patch in importlib.import_module(f"{__name__}.{name}").PATCHES]


def apply() -> None:
    """Installs what this host needs (idempotent: vLLM may load plugins twice)."""
    global _applied
    if _applied:
        return
    from tpu_inference.logger import init_logger

    from tpu_models import host, logs
    logs.quiet()  # again, for plain `vllm serve` (tpu-models serve has them from the start)
    log = init_logger("tpu_models.adapt")
    platform = host.host_platform()
    if platform is not None:
        host.set_tpu_identity(os.environ)
    patching.install(patches(), log)
    if platform is not None:
        log.info("tpu-models: running tpu-inference on JAX platform %r (compatibility layer)",
                 platform)
    _applied = True


# What `tpu-models doctor` reports of the seam, so that it imports this entry alone.
WRITTEN_FOR = features.WRITTEN_FOR
upstream_version = patching.upstream_version


def assessment() -> dict[str, dict]:
    """Feature name -> its patches that apply on this host and what stops them."""
    return {name: {"patches": [p.name for p in group], "problems": problems}
            for name, (group, problems) in patching.assess(patches()).items()}


def ledger() -> str:
    """docs/adaptations.md: what we change upstream, and what to drop when upstream fixes it."""
    return patching.ledger(__name__, MODULES, ON_IMPORT)
