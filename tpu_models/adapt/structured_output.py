"""Structured output (guided decoding): grammar bitmask rows, with and without drafts."""

import dataclasses

from tpu_models.adapt import state
from tpu_models.adapt.guard import GUIDED, GUIDED_WITH_DRAFTS, Patch, Target

RUNNER = "tpu_inference.runner"


def grammar_rows_per_logits_row() -> None:
    # vLLM sends one bitmask row per structured request and sampled position (1 +
    # its drafts), in structured_output_request_ids order; tpu-inference took one
    # row per request walking the ids sorted, so concurrent requests could be
    # masked by each other's grammar, and with drafts the scheduler then aborted
    # requests (500). Request i owns rows i + (drafts of the requests before it).
    import numpy as np
    from tpu_inference.runner.structured_decoding_manager import StructuredDecodingManager
    from tpu_inference.runner.tpu_runner import TPUModelRunner
    from tpu_inference.utils import device_array

    original_sample = TPUModelRunner.sample_tokens
    original_prepare = StructuredDecodingManager.prepare_structured_decoding_input

    def sample_tokens(self, grammar_output):
        # The runner drops the scheduler output before masking: keep the draft counts.
        if grammar_output is not None and self.execute_model_state is not None:
            scheduled = self.execute_model_state.scheduler_output
            state.of(self).draft_tokens = {
                req_id: len(tokens)
                for req_id, tokens in scheduled.scheduled_spec_decode_tokens.items()}
        return original_sample(self, grammar_output)

    def prepare_structured_decoding_input(self, logits, grammar_output):
        if self.runner.vllm_config.sharding_config.total_dp_size > 1:
            return original_prepare(self, logits, grammar_output)  # rows reordered per rank
        drafts = state.of(self.runner).draft_tokens
        first_row, row = {}, 0
        for req_id in self.runner.input_batch.req_ids:
            first_row[req_id] = row
            row += 1 + drafts.get(req_id, 0)
        rows = logits.shape[0]
        bitmask = np.zeros((rows, grammar_output.grammar_bitmask.shape[1]), np.int32)
        required = np.zeros((rows, 1), np.bool_)
        sent = 0  # rows of grammar_output.grammar_bitmask used so far
        for req_id in grammar_output.structured_output_request_ids:
            n = 1 + drafts.get(req_id, 0)
            if (first := first_row.get(req_id)) is not None:
                bitmask[first:first + n] = grammar_output.grammar_bitmask[sent:sent + n]
                required[first:first + n] = True
            sent += n
        return device_array(self.runner.mesh,
                            (required, bitmask, self.runner.structured_decode_arange))

    TPUModelRunner.sample_tokens = sample_tokens
    StructuredDecodingManager.prepare_structured_decoding_input = prepare_structured_decoding_input


def drafts_on_the_host() -> None:
    # vLLM trims each guided request's draft list in place against its grammar;
    # tpu-inference handed the drafts over as one device array (AttributeError:
    # __delitem__, a dead engine). vLLM asks for them only on that path.
    # Under async scheduling vLLM takes the drafts after the next step's inputs were
    # prepared, and tpu-inference named their rows by that step's batch: when a
    # request had finished, its rows moved and a guided request's grammar advanced
    # over another request's drafts (masking its next tokens in the wrong state).
    # The rows are named by the batch that drafted them.
    import numpy as np
    from tpu_inference.runner.speculative_decoding_manager import SpeculativeDecodingManager

    original_take = SpeculativeDecodingManager.take_draft_token_ids
    original_propose = SpeculativeDecodingManager.propose_draft_token_ids

    def propose_draft_token_ids(self, *args, **kwargs):
        result = original_propose(self, *args, **kwargs)
        self.drafted_for = list(self.runner.input_batch.req_ids)
        return result

    def take_draft_token_ids(self):
        drafts = original_take(self)
        if drafts is None:
            return None
        ids = drafts.draft_token_ids  # a device array, or a list of its rows (and empty lists)
        ids = (np.asarray(ids).tolist() if hasattr(ids, "shape") else
               [row if isinstance(row, list) else np.asarray(row).tolist() for row in ids])
        req_ids = getattr(self, "drafted_for", None) or drafts.req_ids
        return dataclasses.replace(drafts, req_ids=req_ids, draft_token_ids=ids)

    SpeculativeDecodingManager.propose_draft_token_ids = propose_draft_token_ids
    SpeculativeDecodingManager.take_draft_token_ids = take_draft_token_ids


_PROPOSE_DRAFTS = (
    "self sampled_output logits_indices_selector last_sampled_token_id num_rejected_tokens "
    "discard_sampled_tokens_req_indices aux_hidden_states attn_metadata async_scheduling "
    "spec_decode_metadata scheduler_output input_ids hidden_states")
PATCHES = [
    Patch("grammar rows per logits row", GUIDED, (
        Target(f"{RUNNER}.tpu_runner.TPUModelRunner.sample_tokens", "self grammar_output"),
        Target(f"{RUNNER}.structured_decoding_manager.StructuredDecodingManager"
               ".prepare_structured_decoding_input", "self logits grammar_output")),
        "concurrent guided requests could be masked by each other's grammar",
        "tests/test_demo.py::test_guided_decoding_always_valid_under_concurrency",
        grammar_rows_per_logits_row,
        upstream="tpu-inference issue 1531, PR 1563 (open; without draft rows)"),
    Patch("draft tokens handed over on the host", GUIDED_WITH_DRAFTS, (
        Target(f"{RUNNER}.speculative_decoding_manager.SpeculativeDecodingManager"
               ".take_draft_token_ids", "self"),
        Target(f"{RUNNER}.speculative_decoding_manager.SpeculativeDecodingManager"
               ".propose_draft_token_ids", _PROPOSE_DRAFTS)),
        "a guided request beside drafts killed the engine; async, its grammar took another's drafts",
        "tests/test_spec_decode.py::test_speculative_demo_gives_the_text_of_plain_decoding",
        drafts_on_the_host),
]
