"""Guided decoding (structured outputs): each grammar's bitmask rows on the logits
rows they mask, and drafts handed to the grammars on the host.

vLLM sends one bitmask row per structured request and sampled position (1 + its
drafts), in `structured_output_request_ids` order; tpu-inference took one row per
request walking the ids sorted, so concurrent requests could be masked by each
other's grammar, and with drafts the scheduler then aborted requests (500).
`grammar_rows` lays them out as the logits are: request i owns rows i + (drafts of
the requests before it). `draft_counts` is what it needs of the scheduler output,
which the runner drops before the rows are laid out.

vLLM trims each guided request's draft list in place against its grammar;
tpu-inference handed the drafts over as one device array (AttributeError:
__delitem__, a dead engine). vLLM asks for them only on that path. Under async
scheduling vLLM takes the drafts after the next step's inputs were prepared, and
tpu-inference named their rows by that step's batch: when a request had finished,
its rows moved and a guided request's grammar advanced over another request's
drafts (masking its next tokens in the wrong state). `on_the_host` names the rows
by the batch that drafted them.
The seam (adapt.structured_output) calls these from the runner.
"""

import dataclasses


def draft_counts(scheduler_output) -> dict[str, int]:
    """Request id -> its draft tokens this step."""
    return {req_id: len(tokens)
            for req_id, tokens in scheduler_output.scheduled_spec_decode_tokens.items()}


def grammar_rows(req_ids, drafts: dict[str, int], grammar_output, rows: int):
    """(required [rows, 1] bool, bitmask [rows, words] int32): the grammar rows vLLM
    sent, each on the logits row it masks; `req_ids`: the batch's requests in the
    order of its logits rows, `drafts`: draft_counts of the step."""
    import numpy as np
    first_row, row = {}, 0
    for req_id in req_ids:
        first_row[req_id] = row
        row += 1 + drafts.get(req_id, 0)
    bitmask = np.zeros((rows, grammar_output.grammar_bitmask.shape[1]), np.int32)
    required = np.zeros((rows, 1), np.bool_)
    sent = 0  # rows of grammar_output.grammar_bitmask used so far
    for req_id in grammar_output.structured_output_request_ids:
        n = 1 + drafts.get(req_id, 0)
        if (first := first_row.get(req_id)) is not None:
            bitmask[first:first + n] = grammar_output.grammar_bitmask[sent:sent + n]
            required[first:first + n] = True
        sent += n
    return required, bitmask


def on_the_host(drafts, drafted_for: list[str] | None):
    """tpu-inference's DraftTokenIds with each request's drafts as a list of ids and
    its rows named by `drafted_for` (the batch that drafted them), when known."""
    import numpy as np
    ids = drafts.draft_token_ids  # a device array, or a list of its rows (and empty lists)
    ids = (np.asarray(ids).tolist() if hasattr(ids, "shape") else
           [row if isinstance(row, list) else np.asarray(row).tolist() for row in ids])
    return dataclasses.replace(drafts, req_ids=drafted_for or drafts.req_ids,
                               draft_token_ids=ids)
