"""`--reasoning-parser tunix`: replies in Tunix's GRPO format, `<reasoning>R</reasoning>
<answer>A</answer>`, served with R as the message's `reasoning` and A as its `content`.

The tags are plain text to the tokenizer (Gemma 3 has no token for them): several
tokens each, split across streamed deltas. So the parser reads text, never token
ids, and holds back a possible tag start until the next delta settles it. A reply
is read left to right in phases:

- start: whitespace is dropped; `<reasoning>` opens the reasoning, `<answer>` the
  answer; any other text ends parsing (the reply is content as generated);
- reasoning, up to `</reasoning>`: a reply that never closes it is all reasoning
  with no content, as vLLM's `<think>` parsers read one;
- between: whitespace is dropped; `<answer>` opens the answer, other text ends parsing;
- answer, up to `</answer>`; after it, parsing ends: the rest is content as generated.

Guided decoding (`response_format`, `structured_outputs`) constrains the text after
`</reasoning>`, so a guided reply's content is the constrained text, without tags.
"""

import enum
from collections.abc import Iterable, Sequence

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.reasoning import ReasoningParser

REASONING_START, REASONING_END = "<reasoning>", "</reasoning>"
ANSWER_START, ANSWER_END = "<answer>", "</answer>"


class Phase(enum.Enum):
    START = "start"  # before any text: a tag or the reply's plain text
    REASONING = "reasoning"
    BETWEEN = "between"  # after </reasoning>, before <answer>
    ANSWER = "answer"
    DONE = "done"  # parsing ended: the rest is content, verbatim


# Phase -> {tag that may come next: the phase it opens}; phase -> (its end tag, next phase).
OPENERS = {Phase.START: {REASONING_START: Phase.REASONING, ANSWER_START: Phase.ANSWER},
           Phase.BETWEEN: {ANSWER_START: Phase.ANSWER}}
CLOSERS = {Phase.REASONING: (REASONING_END, Phase.BETWEEN), Phase.ANSWER: (ANSWER_END, Phase.DONE)}


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class Splitter:
    """A reply read in pieces: `feed` returns the (reasoning, content) text each piece
    settles; `finish` settles what is still held back (a possible tag start)."""

    def __init__(self):
        self.phase = Phase.START
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        text, self.held = self.held + text, ""
        while text:
            if self.phase is Phase.DONE:
                content.append(text)
                break
            if self.phase in CLOSERS:
                tag, after = CLOSERS[self.phase]
                out = reasoning if self.phase is Phase.REASONING else content
                end = text.find(tag)
                if end < 0:
                    keep = partial_tag(text, tag)
                    out.append(text[:len(text) - keep])
                    self.held = text[len(text) - keep:]
                    break
                out.append(text[:end])
                text, self.phase = text[end + len(tag):], after
                continue
            # START or BETWEEN: whitespace, then a tag that opens the next phase.
            rest = text.lstrip()
            opened = next((tag for tag in OPENERS[self.phase] if rest.startswith(tag)), None)
            if opened is not None:
                self.phase = OPENERS[self.phase][opened]
                text = rest[len(opened):]
            elif not rest or any(tag.startswith(rest) for tag in OPENERS[self.phase]):
                self.held = text  # whitespace, or a tag not yet complete
                break
            else:
                self.phase = Phase.DONE
                text = rest
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held back, settled as the reply ends: a tag that never completed is text."""
        held, self.held = self.held, ""
        if self.phase is Phase.REASONING:
            return held, ""
        return "", held if self.phase in (Phase.ANSWER, Phase.DONE) else held.strip()


def split(reply: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply; None where it has none."""
    splitter = Splitter()
    reasoning, content = splitter.feed(reply)
    tail_reasoning, tail_content = splitter.finish()
    return (reasoning + tail_reasoning) or None, (content + tail_content) or None


class TunixReasoningParser(ReasoningParser):
    """Tunix's tags through vLLM's ReasoningParser interface (kept for out-of-tree parsers).

    Two consumers ask where reasoning ends. The structured-output gate (engine core)
    asks `is_reasoning_end` of the prompt, then `is_reasoning_end_streaming` of each
    step's new tokens: the grammar starts after `</reasoning>`. The chat frontend, as
    `engine_based_streaming` is set, asks `has_engine_confirmed_reasoning_end` instead
    and hands every delta to `extract_reasoning_streaming` until it says yes: only
    once the answer has closed, so that streamed deltas lose the answer's tags too.
    """

    engine_based_streaming = True

    def __init__(self, tokenizer, *args, **kwargs):
        super().__init__(tokenizer, *args, **kwargs)
        self.stream = Splitter()
        self.counted: tuple[list[int], Splitter, int] = ([], Splitter(), 0)

    @property
    def reasoning_start_str(self) -> str:
        return REASONING_START

    @property
    def reasoning_end_str(self) -> str:
        return REASONING_END

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.model_tokenizer.decode(list(token_ids))

    # Whole replies.
    def extract_reasoning(self, model_output: str, request) -> tuple[str | None, str | None]:
        return split(model_output)

    # Streamed replies: one parser per request and choice.
    def extract_reasoning_streaming(self, previous_text: str, current_text: str,
                                    delta_text: str, previous_token_ids: Sequence[int],
                                    current_token_ids: Sequence[int],
                                    delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        return self.delta(*self.stream.feed(delta_text))

    def finish_streaming(self) -> DeltaMessage | None:
        return self.delta(*self.stream.finish())

    def has_engine_confirmed_reasoning_end(self) -> bool:
        return self.stream.phase is Phase.DONE

    @staticmethod
    def delta(reasoning: str, content: str) -> DeltaMessage | None:
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content or None)

    # Where reasoning ends, in token ids: the structured-output gate.
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        # Called with the prompt. Tunix's own prompt names the tags in its instructions
        # ("between <reasoning> and </reasoning>"): only a prompt that itself ends
        # with a closed reasoning block leaves the reply nothing to reason.
        return self.decode(input_ids).rstrip().endswith(REASONING_END)

    def is_reasoning_end_streaming(self, input_ids: Sequence[int],
                                   delta_ids: Iterable[int]) -> bool:
        """Whether `</reasoning>` completes within the step's new tokens `delta_ids`
        (the tail of `input_ids`): decodes only them and the tokens a tag could
        start in (every token is at least one character of an ASCII tag)."""
        count = len(list(delta_ids))
        if count == 0:
            return False
        window = list(input_ids[-(count + len(REASONING_END)):])
        before = self.decode(window[:-count]).count(REASONING_END)
        return self.decode(window).count(REASONING_END) > before

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The ids after the token that completes `</reasoning>` ([] if none does)."""
        if REASONING_END not in self.decode(input_ids):
            return []
        low, high = 0, len(input_ids) - 1  # bisect for that token
        while low < high:
            middle = (low + high) // 2
            if REASONING_END in self.decode(input_ids[:middle + 1]):
                high = middle
            else:
                low = middle + 1
        return input_ids[low + 1:]

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens that carry reasoning text (the tags' own tokens excluded). A stream with
        continuous usage asks at every chunk, the ids one chunk longer: carry on from there."""
        seen, splitter, count = self.counted
        if list(token_ids[:len(seen)]) != seen:
            seen, splitter, count = [], Splitter(), 0
        for token in token_ids[len(seen):]:
            count += bool(splitter.feed(self.decode([token]))[0])
        self.counted = (list(token_ids), splitter, count)
        return count
