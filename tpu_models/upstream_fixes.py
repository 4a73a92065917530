"""Fixes for tpu-inference bugs that give wrong results on every platform, TPU included.

Each is a small wrapper around the original, applied only to the tpu-inference
version it was found in (FIXED_IN_VERSION); on any other version nothing is
touched. Host-specific adaptations live in server/portability.py instead.
"""

import dataclasses
import importlib.metadata

from vllm.logger import init_logger

logger = init_logger("tpu_models.upstream_fixes")

FIXED_IN_VERSION = "0.32.0"

_applied = False


def apply() -> None:
    global _applied
    if _applied or importlib.metadata.version("tpu-inference") != FIXED_IN_VERSION:
        return
    _grammar_rows_in_request_order()
    _applied = True


def _grammar_rows_in_request_order() -> None:
    """Guided decoding: give each request its own grammar bitmask row.

    vLLM orders the bitmask rows as GrammarOutput.structured_output_request_ids
    (scheduling order); tpu-inference 0.32.0 walks the ids *sorted* and takes
    rows in that order, so with two or more concurrent guided requests a
    request could be masked by another's grammar (the scheduler then rejects
    the token and aborts it). Re-ordering the rows to sorted id order makes
    both agree; a batch already in sorted order is unchanged.
    """
    from tpu_inference.runner.structured_decoding_manager import StructuredDecodingManager

    original = StructuredDecodingManager.prepare_structured_decoding_input

    def prepare_structured_decoding_input(self, logits, grammar_output):
        ids = list(grammar_output.structured_output_request_ids)
        order = sorted(range(len(ids)), key=ids.__getitem__)
        if order != list(range(len(ids))):
            grammar_output = dataclasses.replace(
                grammar_output,
                structured_output_request_ids=[ids[i] for i in order],
                grammar_bitmask=grammar_output.grammar_bitmask[order],
                num_acceptable_drafts=None if grammar_output.num_acceptable_drafts is None
                else [grammar_output.num_acceptable_drafts[i] for i in order])
        return original(self, logits, grammar_output)

    StructuredDecodingManager.prepare_structured_decoding_input = prepare_structured_decoding_input
