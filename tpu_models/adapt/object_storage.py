"""vLLM's model config: a checkpoint `tpu-models export` left unfinished is refused before it is pulled.

An export to gs:// writes a `.incomplete` marker first and its manifest last
(loaders/export_marker.py). Our model classes check them when they open the
checkpoint; tpu-inference's own classes (a plain Qwen3 export) never looked,
and were served. vLLM builds a ModelConfig for every model it serves (the
target, a speculative draft) and pulls an object-storage model's config.json
and tokenizer there, before any weight is read: the markers are checked at
that point, for every architecture, under plain `vllm serve` as under
`tpu-models serve`. A local directory (a copy of one) is checked the same way.
"""

import os

from tpu_models.adapt.guard import EXPORT_MARKERS, Patch, Target


def markers_checked_before_the_pull() -> None:
    from vllm.config.model import ModelConfig

    from tpu_models.loaders.export_marker import check_export_complete
    from tpu_models.loaders.hf import CheckpointError
    from tpu_models.loaders.object_storage import is_object_storage

    original = ModelConfig.maybe_pull_model_tokenizer_for_runai

    def maybe_pull_model_tokenizer_for_runai(self, model, tokenizer):
        if not self.model_weights and (is_object_storage(str(model)) or os.path.isdir(model)):
            check_export_complete(model, CheckpointError)  # names the prefix and each fault
        return original(self, model, tokenizer)

    ModelConfig.maybe_pull_model_tokenizer_for_runai = maybe_pull_model_tokenizer_for_runai


PATCHES = [
    Patch("export markers checked before the pull", EXPORT_MARKERS, (
        Target("vllm.config.model.ModelConfig.maybe_pull_model_tokenizer_for_runai",
               "self model tokenizer"),),
        "an export cut short of a built-in architecture (plain Qwen3) was served",
        "tests/test_object_storage_export.py::"
        "test_a_qwen3_export_cut_short_is_refused_by_tpu_models_serve_and_vllm_serve",
        markers_checked_before_the_pull),
]
