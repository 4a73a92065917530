"""Reasoning and tool-call output, through the real `vllm serve` and the openai client.

Tiny models trained to emit the markup (tests/emitting.py), transformers' greedy
replies the reference: Tunix's `<reasoning>`/`<answer>` tags on Gemma 3 with
`--reasoning-parser tunix` (tpu_models/reasoning.py), served by plain `vllm serve`;
Qwen3's `<think>` with vLLM's qwen3 parser and hermes tool calls on Qwen3-structural.
vLLM 0.32 names the reasoning field `reasoning` (`reasoning_content` is gone).
The parser's own logic is tested first, without a server.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from tests import emitting

# Tunix's GRPO system prompt names the tags itself: the parser must not take the
# prompt's "</reasoning>" for the end of the reply's reasoning.
SYSTEM = ("Think about the problem and place your reasoning between <reasoning> and "
          "</reasoning>. Then give the final answer between <answer> and </answer>.")
TUNIX = {
    "closed": {"messages": [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "What is 7 + 5?"}],
               "reply": "<reasoning>7 plus 5 makes 12.</reasoning>\n<answer>12</answer>"},
    "never-closed": {"messages": [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "Is 9 prime?"}],
                     "reply": "<reasoning>9 is 3 times 3, so it is not"},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
QWEN3 = {
    "think": {"messages": [{"role": "user", "content": "Why is the sky blue?"}],
              "reply": "<think>\nAir scatters blue light more.\n</think>\n\nRayleigh scattering."},
    "tool": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
             "reply": "<think>\nI should ask the weather tool.\n</think>\n\n<tool_call>\n"
                      '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
}
# Qwen3's markup is one token each in its vocabulary, as vLLM's qwen3 parser expects.
QWEN3_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


# --- The parser, without a server -------------------------------------------------------

SPLITS = {  # reply -> (reasoning, content)
    "<reasoning>R r</reasoning>\n<answer>A a</answer>": ("R r", "A a"),
    "\n<reasoning>a < b</reasoning>\n\n<answer>yes</answer>": ("a < b", "yes"),
    "<reasoning>never closed <answer>1": ("never closed <answer>1", None),
    "<reasoning>cut in the tag</reas": ("cut in the tag</reas", None),
    "<reasoning>R</reasoning>": ("R", None),
    "<reasoning>R</reasoning>\n<answer>cut": ("R", "cut"),
    "<reasoning>R</reasoning>\n<answer>A</answer>\nmore": ("R", "A\nmore"),
    "<reasoning>R</reasoning> untagged <answer>A</answer>": ("R", "untagged <answer>A</answer>"),
    "<answer>42</answer>": (None, "42"),
    "plain <reasoning>": (None, "plain <reasoning>"),
    "<reas": (None, "<reas"),
    "  ": (None, None),
}


@pytest.mark.parametrize("reply", SPLITS)
def test_split_whole_and_in_pieces_of_every_size(reply):
    from tpu_models.reasoning import Splitter, split
    assert split(reply) == SPLITS[reply]
    for size in range(1, len(reply) + 1):
        splitter, reasoning, content = Splitter(), "", ""
        for piece in [reply[i:i + size] for i in range(0, len(reply), size)] + [None]:
            r, c = splitter.feed(piece) if piece is not None else splitter.finish()
            reasoning, content = reasoning + r, content + c
        assert (reasoning or None, content or None) == SPLITS[reply], size


@pytest.fixture(scope="module")
def tunix_parser(tmp_path_factory):
    """vLLM's own frontend parser class for `--reasoning-parser tunix`, registered as our
    plugin registers it, and a tokenizer in which the tags are several tokens each."""
    from tpu_models import plugin
    from vllm.parser.parser_manager import ParserManager
    from vllm.reasoning import ReasoningParserManager

    for name, (module, class_name) in plugin.REASONING_PARSERS.items():
        ReasoningParserManager.register_lazy_module(name, module, class_name)
    tokenizer = emitting.make_tokenizer(tmp_path_factory.mktemp("tok"), emitting.training_texts(
        list(TUNIX.values())))
    assert len(tokenizer.encode("</reasoning>", add_special_tokens=False)) > 1
    return ParserManager.get_parser(reasoning_parser_name="tunix", tokenizer=tokenizer), tokenizer


def chat_request():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    return ChatCompletionRequest(model="m", messages=TUNIX["closed"]["messages"])


@pytest.mark.parametrize("reply", SPLITS)
def test_frontend_streams_token_by_token_as_it_parses_whole(tunix_parser, reply):
    parser_cls, tokenizer = tunix_parser
    prompt = emitting.prompt_ids(tokenizer, TUNIX["closed"])
    ids = tokenizer.encode(reply, add_special_tokens=False)
    assert parser_cls(tokenizer).parse(reply, chat_request())[:2] == SPLITS[reply]
    parser, request, reasoning, content = parser_cls(tokenizer), chat_request(), "", ""
    for i, token in enumerate(ids):
        text = tokenizer.decode(ids[:i + 1])[len(tokenizer.decode(ids[:i])):]
        delta = parser.parse_delta(text, [token], request, prompt, finished=i == len(ids) - 1)
        reasoning += (delta and delta.reasoning) or ""
        content += (delta and delta.content) or ""
    assert (reasoning or None, content or None) == SPLITS[reply]


def test_structured_output_gate_opens_after_the_closing_tag(tunix_parser):
    """The engine's structured-output manager asks `is_reasoning_end` of the prompt,
    then `is_reasoning_end_streaming` of each step's new tokens."""
    parser_cls, tokenizer = tunix_parser
    parser = parser_cls(tokenizer).reasoning_parser
    prompt = emitting.prompt_ids(tokenizer, TUNIX["closed"])
    assert not parser.is_reasoning_end(prompt)  # its instructions name "</reasoning>"
    assert parser.is_reasoning_end(tokenizer.encode("<reasoning>R</reasoning>\n"))
    reply = tokenizer.encode(TUNIX["closed"]["reply"], add_special_tokens=False)
    ends = [i for i in range(len(reply))
            if parser.is_reasoning_end_streaming(prompt + reply[:i + 1], reply[i:i + 1])]
    assert len(ends) == 1
    assert "</reasoning>" in tokenizer.decode(reply[:ends[0] + 1])
    assert "</reasoning>" not in tokenizer.decode(reply[:ends[0]])
    assert parser.extract_content_ids(reply) == reply[ends[0] + 1:]
    # Two tokens at once (a draft), the second completing the tag.
    end = ends[0] + 1
    assert parser.is_reasoning_end_streaming(prompt + reply[:end], reply[end - 2:end])
    whole = parser_cls(tokenizer).reasoning_parser.count_reasoning_tokens(reply)
    assert 0 < whole < len(reply)
    # Asked again at every chunk, as a stream with continuous usage does:
    counts = [parser.count_reasoning_tokens(tuple(reply[:n])) for n in range(len(reply) + 1)]
    assert counts == sorted(counts) and counts[-1] == whole


# --- Through `vllm serve` ---------------------------------------------------------------

@dataclasses.dataclass
class Trained:
    directory: Path
    ids: dict  # example name -> (prompt ids, reply ids + EOS), transformers' greedy


def trained(make, directory: Path, examples: dict, **kwargs) -> Trained:
    from transformers import AutoTokenizer

    from tests.tiny import Reference
    directory = make(directory, list(examples.values()), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = dict(zip(examples, emitting.sequences(tokenizer, list(examples.values()))))
    reference = Reference(directory)
    with emitting.one_thread():
        for name, (prompt, reply) in ids.items():
            assert reference.greedy(prompt, len(reply)) == reply, name
    return Trained(directory, ids)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """name -> (server, its model): Gemma 3 with `--reasoning-parser tunix` under plain
    `vllm serve`, and Qwen3-structural with qwen3 + hermes under `tpu-models serve`. Each
    launches as soon as its model is trained: Qwen3 trains while Gemma's server imports vLLM."""
    from tpu_models.harness.serve_process import PLAIN_VLLM, Server
    root = tmp_path_factory.mktemp("reasoning")
    common = ("--max-model-len", "256", "--kv-cache-memory-bytes", str(32 << 20),
              "--served-model-name", "tiny")
    running = {}
    try:
        gemma = trained(emitting.make_gemma3, root / "gemma3", TUNIX)
        running["tunix"] = Server(
            gemma.directory, *common, "--reasoning-parser", "tunix", "--dtype", "float32",
            "--max-num-batched-tokens", "256", "--max-num-seqs", "16", "--host", "127.0.0.1",
            command=PLAIN_VLLM, log=root / "tunix.log").launch()
        qwen3 = trained(emitting.make_qwen3_structural, root / "qwen3", QWEN3, added=QWEN3_TOKENS)
        running["qwen3"] = Server(
            qwen3.directory, *common, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes", log=root / "qwen3.log").launch()
        for server in running.values():
            server.start()
        yield {"tunix": (running["tunix"], gemma), "qwen3": (running["qwen3"], qwen3)}
    finally:
        for server in running.values():
            server.stop()


@dataclasses.dataclass
class Reply:
    reasoning: str | None
    content: str | None
    tool_calls: list  # (name, arguments as a JSON string)
    finish_reason: str
    token_ids: list
    pieces: int = 1  # chunks that carried reasoning or content


def chat(server, example: dict, stream: bool, **extra) -> Reply:
    body = {"return_token_ids": True, **extra.pop("body", {})}
    request = {"model": "tiny", "messages": example["messages"], "temperature": 0,
               "max_tokens": 64, "stream": stream, "extra_body": body, **extra}
    if "tools" in example:
        request["tools"] = example["tools"]
    response = server.client().chat.completions.create(**request)
    if not stream:
        choice = response.choices[0]
        message = choice.message
        assert "reasoning_content" not in (message.model_extra or {})
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        return Reply(message.model_extra.get("reasoning"), message.content, calls,
                     choice.finish_reason, choice.token_ids)
    reasoning, content, calls, token_ids, finish, pieces = "", "", {}, [], None, 0
    for chunk in response:
        for choice in chunk.choices:
            delta = choice.delta
            text = ((delta.model_extra or {}).get("reasoning") or "", delta.content or "")
            reasoning, content = reasoning + text[0], content + text[1]
            pieces += any(text)
            for call in delta.tool_calls or []:
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""),
                                     arguments + (call.function.arguments or ""))
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            finish = choice.finish_reason or finish
    return Reply(reasoning or None, content or None, [calls[i] for i in sorted(calls)], finish,
                 token_ids, pieces)


def cut_inside_closing_tag(reply_ids: list[int], tokenizer) -> int:
    """The first reply length whose text ends part-way through `</reasoning>`."""
    from tpu_models.reasoning import REASONING_END, partial_tag
    return next(n for n in range(1, len(reply_ids))
                if partial_tag(tokenizer.decode(reply_ids[:n]), REASONING_END) > 1)


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tunix_reasoning_and_answer(servers, stream):
    server, model = servers["tunix"]
    for name, expected in [("closed", ("7 plus 5 makes 12.", "12", "stop")),
                           ("never-closed", ("9 is 3 times 3, so it is not", None, "stop"))]:
        _, reply = model.ids[name]
        got = chat(server, TUNIX[name], stream)
        assert got.token_ids == reply, (name, got)  # transformers' greedy, EOS included
        assert (got.reasoning, got.content, got.finish_reason) == expected, (name, got)
        assert got.tool_calls == []
        # How many pieces a stream arrives in depends on load: vLLM merges the deltas a
        # client has not read yet, into one under a loaded suite (token by token:
        # test_frontend_streams_token_by_token_*). The parsed text above is the check.


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tunix_reply_cut_inside_the_closing_tag_keeps_it_as_reasoning(servers, stream):
    from transformers import AutoTokenizer
    server, model = servers["tunix"]
    tokenizer = AutoTokenizer.from_pretrained(model.directory)
    _, reply = model.ids["closed"]
    cut = cut_inside_closing_tag(reply, tokenizer)
    got = chat(server, TUNIX["closed"], stream, max_tokens=cut)
    text = tokenizer.decode(reply[:cut])
    assert (got.reasoning, got.content, got.finish_reason) == (
        text.removeprefix("<reasoning>"), None, "length"), got


@pytest.mark.e2e
def test_tunix_guided_decoding_constrains_the_answer_only(servers):
    # The reasoning is the model's own; the grammar starts after </reasoning>.
    got = chat(servers["tunix"][0], TUNIX["closed"], False, body={"structured_outputs": {
        "choice": ["yes", "no"]}})
    assert got.reasoning == "7 plus 5 makes 12." and got.content in ("yes", "no"), got


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_qwen3_think_and_hermes_tool_call(servers, stream):
    server, model = servers["qwen3"]
    got = chat(server, QWEN3["think"], stream)
    assert got.token_ids == model.ids["think"][1], got
    assert (got.reasoning.strip(), got.content.strip(), got.tool_calls) == (
        "Air scatters blue light more.", "Rayleigh scattering.", []), got
    got = chat(server, QWEN3["tool"], stream)
    assert got.token_ids == model.ids["tool"][1], got
    assert got.reasoning.strip() == "I should ask the weather tool.", got
    assert not (got.content or "").strip(), got
    assert len(got.tool_calls) == 1 and got.tool_calls[0][0] == "get_weather", got
    assert json.loads(got.tool_calls[0][1]) == {"city": "Paris"}, got
    assert got.finish_reason == "tool_calls", got
