"""vLLM's model config: a checkpoint `tpu-models export` left unfinished is refused before it is pulled."""

from tpu_models.features import EXPORT_MARKERS
from tpu_models.patching import Patch, Target


def pull_after_the_export_check(original, self, model, tokenizer):
    """ModelConfig.maybe_pull_model_tokenizer_for_runai: an unfinished export refused
    first, whatever the architecture (loaders.object_storage)."""
    from tpu_models.loaders.object_storage import refuse_an_unfinished_export
    if not self.model_weights:
        refuse_an_unfinished_export(model)
    return original(self, model, tokenizer)


PATCHES = [
    Patch("export markers checked before the pull", EXPORT_MARKERS, (
        Target("vllm.config.model.ModelConfig.maybe_pull_model_tokenizer_for_runai",
               "self model tokenizer", pull_after_the_export_check), ),
        "an export cut short of a built-in architecture (plain Qwen3) was served",
        "tests/test_object_storage_export.py::"
        "test_a_qwen3_export_cut_short_is_refused_by_tpu_models_serve_and_vllm_serve"),
]
