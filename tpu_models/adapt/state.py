"""The seam's state: what one replaced upstream method hands a later one, named once.

tpu-inference's runner calls the methods the seam replaces in a fixed order. At
start-up its compilation manager runs `capture_model`, which calls the flushes
and the step's precompilation. Each step, `execute_model` runs `_prepare_inputs`,
inside which `TPUSupportedSamplingMetadata.from_input_batch` builds the sampling
metadata; then `sample_tokens` runs `_sample_from_logits`, which calls `sample`
and, beside drafts, the rejection sampler (vLLM calls the two strictly in turn);
with a grammar, `sample_tokens` first lays out its bitmask rows.
What one replacement learns and a later one needs is a field of `SeamState`,
kept in one attribute of the runner (`of(runner)`: `runner.tpu_models_state`);
the seam drops no other attribute on an upstream object. `from_input_batch` is
handed no runner: it reads the state of the runner whose `_prepare_inputs` is
under way (`being_prepared`).
"""

import contextlib
import contextvars
import dataclasses
import threading

ATTRIBUTE = "tpu_models_state"


@dataclasses.dataclass
class Step:
    """What `_prepare_inputs` knows of the step it prepares and `from_input_batch`,
    which sees only the input batch, needs for the extended sampler's metadata."""
    num_scheduled: dict[str, int]  # request id -> tokens scheduled this step
    requests: dict  # request id -> the runner's CachedRequestState (runner.requests)
    drafts: int  # draft tokens a request may have this step (0: no speculative decoding)


@dataclasses.dataclass
class SeamState:
    """A runner's state in the seam (one engine's). Each field names the replacement
    that writes it (adapt.MODULE.function) and those that read it."""
    # sampling._prepare_inputs -> sampling.from_input_batch: the step under way.
    step: Step | None = None
    # sampling.prepare_inputs -> sampling.from_input_batch: the live requests that ask
    # for something the extended sampler adds (sampler.metadata.asks_for_extras),
    # noted when first scheduled.
    wanting: set[str] = dataclasses.field(default_factory=set)
    # structured_output.sample_tokens -> structured_output.prepare_structured_decoding_input:
    # request id -> its draft tokens this step (the runner drops the scheduler
    # output before the grammar's rows are laid out).
    draft_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    # structured_output.propose_draft_token_ids -> structured_output.take_draft_token_ids:
    # the requests, in the batch's order, whose drafts were proposed last.
    drafted_for: list[str] | None = None
    # speculative.steps.sample_from_logits (adapt.spec_fusion): a fused EAGLE-3 step
    # failed to trace or compile, so every later step runs tpu-inference's calls.
    unfused: bool = False
    # compilation.ready_buckets_first -> compilation.ready_buckets_only: while
    # capture_model runs off-TPU, the token buckets compiled before the server is ready.
    ready_buckets: list[int] | None = None
    # compilation.ready_buckets_first -> compilation.flush_of_what_is_left: while
    # capture_model runs, its flushes wait for nothing (the workers' compiles overlap).
    overlapped: bool = False
    # compilation.compiled_ahead_noted -> compilation.flush_of_what_is_left: the warm-up
    # tasks (by id) whose function compiled ahead on a worker, so not run.
    compiled_ahead: set[int] = dataclasses.field(default_factory=set)
    # compilation.ready_buckets_first: the thread compiling the other buckets after ready.
    background: threading.Thread | None = None


def of(runner) -> SeamState:
    """The runner's SeamState, made on first use."""
    state = getattr(runner, ATTRIBUTE, None)
    if state is None:
        state = SeamState()
        setattr(runner, ATTRIBUTE, state)
    return state


_PREPARING: contextvars.ContextVar[SeamState | None] = contextvars.ContextVar(
    "tpu_models_preparing", default=None)


@contextlib.contextmanager
def preparing(state: SeamState):
    """While a runner's `_prepare_inputs` runs: `being_prepared()` is its state."""
    token = _PREPARING.set(state)
    try:
        yield
    finally:
        _PREPARING.reset(token)


def being_prepared() -> SeamState | None:
    return _PREPARING.get()
