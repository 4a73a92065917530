"""Structured output (guided decoding): grammar bitmask rows, with and without drafts."""

from tpu_models import guided
from tpu_models.adapt import state
from tpu_models.features import GUIDED, GUIDED_WITH_DRAFTS
from tpu_models.patching import Patch, Target

RUNNER = "tpu_inference.runner"
MANAGER = f"{RUNNER}.speculative_decoding_manager.SpeculativeDecodingManager"


def sample_tokens(original, self, grammar_output):
    """TPUModelRunner.sample_tokens: the step's draft counts kept (SeamState.draft_tokens),
    as the runner drops the scheduler output before the grammar rows are laid out."""
    if grammar_output is not None and self.execute_model_state is not None:
        scheduled = self.execute_model_state.scheduler_output
        state.of(self).draft_tokens = guided.draft_counts(scheduled)
    return original(self, grammar_output)


def prepare_structured_decoding_input(original, self, logits, grammar_output):
    """StructuredDecodingManager.prepare_structured_decoding_input: each grammar row on
    the logits row it masks (guided.grammar_rows)."""
    from tpu_inference.utils import device_array
    runner = self.runner
    if runner.vllm_config.sharding_config.total_dp_size > 1:
        return original(self, logits, grammar_output)  # rows reordered per rank
    required, bitmask = guided.grammar_rows(runner.input_batch.req_ids,
                                            state.of(runner).draft_tokens, grammar_output,
                                            logits.shape[0])
    return device_array(runner.mesh, (required, bitmask, runner.structured_decode_arange))


def propose_draft_token_ids(original, self, *args, **kwargs):
    """SpeculativeDecodingManager.propose_draft_token_ids: the batch that drafted noted."""
    result = original(self, *args, **kwargs)
    state.of(self.runner).drafted_for = list(self.runner.input_batch.req_ids)
    return result


def take_draft_token_ids(original, self):
    """SpeculativeDecodingManager.take_draft_token_ids: the drafts on the host, their rows
    named by the batch that drafted them (guided.on_the_host)."""
    drafts = original(self)
    if drafts is None:
        return None
    return guided.on_the_host(drafts, state.of(self.runner).drafted_for)


_PROPOSE_DRAFTS = (
    "self sampled_output logits_indices_selector last_sampled_token_id num_rejected_tokens "
    "discard_sampled_tokens_req_indices aux_hidden_states attn_metadata async_scheduling "
    "spec_decode_metadata scheduler_output input_ids hidden_states")
PATCHES = [
    Patch("grammar rows per logits row", GUIDED, (
        Target(f"{RUNNER}.tpu_runner.TPUModelRunner.sample_tokens", "self grammar_output",
               sample_tokens),
        Target(f"{RUNNER}.structured_decoding_manager.StructuredDecodingManager"
               ".prepare_structured_decoding_input", "self logits grammar_output",
               prepare_structured_decoding_input)),
        "concurrent guided requests could be masked by each other's grammar",
        "tests/test_demo.py::test_guided_decoding_always_valid_under_concurrency",
        upstream="tpu-inference issue 1531, PR 1563 (open; without draft rows)"),
    Patch("draft tokens handed over on the host", GUIDED_WITH_DRAFTS, (
        Target(f"{MANAGER}.take_draft_token_ids", "self", take_draft_token_ids),
        Target(f"{MANAGER}.propose_draft_token_ids", _PROPOSE_DRAFTS, propose_draft_token_ids)),
        "a guided request beside drafts killed the engine; async, its grammar took another's drafts",
        "tests/test_spec_decode.py::test_speculative_demo_gives_the_text_of_plain_decoding"),
]
