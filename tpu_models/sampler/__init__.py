"""The extended sampler: what tpu-inference's sampler (temperature, top-k, top-p)
lacks of vLLM's: min_p, seeds, logit_bias, allowed ids, min_tokens, the presence,
frequency and repetition penalties and bad words.

`metadata` builds a step's `ExtendedMetadata` on the host from its requests;
`programs` holds the device programs that sample and verify drafts with it;
`counts` keeps what each request has seen on the device (`TokenCounts`);
`requests` refuses, before the engine, what a request may not ask of it.

The seam (adapt.sampling) hands tpu-inference's sampler these in place of its own
for a batch in which some request sets one of ours; other batches keep
tpu-inference's metadata and compiled sampler, so requests without them run as
before, for every model tpu-inference runs. A request's presence_penalty, for one:
adapt.sampling's `prepare_inputs` notes that it asks (`metadata.new_requests_asking`,
into the seam's state: adapt.state.Step and SeamState.wanting); its
`from_input_batch` builds the step's metadata (`metadata.for_step`, whose
`_penalty_arrays` fill the `presence` row of `ExtendedMetadata`); its `sample`
runs `programs.sample`, whose `penalize` subtracts it from the logits of each
token the request has output (or, beside drafts, `verify_bonus` runs
`programs.verify`, which applies the same `penalize`).
"""
