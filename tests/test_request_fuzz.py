"""Malformed and out-of-range request values, alone and among ordinary requests:
each gets a 200 or a 4xx, never a 5xx, and the engine keeps serving the ordinary
requests unchanged (vLLM's engine core dies on an exception inside a step)."""

import concurrent.futures
import itertools
import json
import random

import pytest
import requests

from tpu_models.server.serve import DEFAULT_NAME

pytestmark = pytest.mark.e2e

BAD_NUMBERS = [-1, -1e9, 1e30, float("nan"), float("inf"), 2**63, 2**64 + 5, 0.5, "7", "abc", None, True, [], {}, [1]]
BAD_TOKEN_LISTS = [[], [-1], [10**9], [2**40], ["a"], [[1]], list(range(5000)), [None]]
STOPS = [[], [""], ["x" * 100_000], [str(i) for i in range(3000)], [None], 5]
FIELDS = {
    "temperature": BAD_NUMBERS, "top_p": BAD_NUMBERS + [0, 1.5], "top_k": BAD_NUMBERS + [0, -2],
    "min_p": BAD_NUMBERS + [1.5], "presence_penalty": BAD_NUMBERS, "frequency_penalty": [3],
    "repetition_penalty": BAD_NUMBERS + [0], "seed": BAD_NUMBERS + [-(2**63)],
    "n": BAD_NUMBERS + [0, 20_000], "max_tokens": BAD_NUMBERS + [0, 10**6],
    "min_tokens": BAD_NUMBERS + [300], "logprobs": BAD_NUMBERS + [21, 0, 20],
    "prompt_logprobs": BAD_NUMBERS + [21, 0], "echo": ["yes", 3, None],
    "logit_bias": [{"5": 1e9}, {"-1": 1}, {"999999999": 1}, {"a": 1}, {str(i): 1.0 for i in range(5000)}, []],
    "allowed_token_ids": BAD_TOKEN_LISTS, "bad_words": [[""], ["x"] * 5000, [5], "a"],
    "stop_token_ids": BAD_TOKEN_LISTS, "stop": STOPS, "include_stop_str_in_output": ["no", 2],
    "ignore_eos": ["no", 2], "skip_special_tokens": ["no", 2],
    "logprob_token_ids": BAD_TOKEN_LISTS, "thinking_token_budget": BAD_NUMBERS,
    "repetition_detection": [{"max_pattern_size": -1}, {"max_pattern_size": 3, "min_count": 1},
                             {"bogus": 1}, 5],
    "use_beam_search": [True, "x"], "response_format": [{"type": "json_schema"},
                                                        {"type": "nope"}, "json"],
    "prompt": [[], [-1], [10**9], "", None, 5, [[]], [["a"]], list(range(10_000))],
    "structured_outputs": [{"json": "{"}, {"regex": "("}, {"choice": []}, 5],
}


def cases(rng: random.Random):
    """One request per bad value (alone), then random pairs of them."""
    singles = [{name: value} for name, values in FIELDS.items() for value in values]
    pairs = []
    names = list(FIELDS)
    for _ in range(60):
        a, b = rng.sample(names, 2)
        pairs.append({a: rng.choice(FIELDS[a]), b: rng.choice(FIELDS[b])})
    return singles + pairs


def ordinary(server, prompt):
    reply = server.client().completions.create(model=DEFAULT_NAME, prompt=prompt, max_tokens=12,
                                               temperature=0)
    return reply.choices[0].text


def test_fuzzed_requests_get_a_4xx_and_the_server_keeps_serving(demo_server):
    prompts = [f"{name} is {age} and works at {company}" for name, age, company in
               itertools.islice(itertools.product(["Bob", "Ana", "Li"], [30, 41],
                                                  ["Acme", "Globex"]), 8)]
    before = [ordinary(demo_server, p) for p in prompts]
    bodies = cases(random.Random(0))
    assert len(bodies) >= 200

    def send(body):
        payload = {"model": DEFAULT_NAME, "prompt": "Bob is 30", "max_tokens": 4, **body}
        data = json.dumps(payload, allow_nan=True)
        response = requests.post(f"{demo_server.url}/v1/completions", data=data, timeout=120,
                                 headers={**demo_server.headers(),
                                          "Content-Type": "application/json"})
        return body, response.status_code, response.text[:300]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        fuzzed = [pool.submit(send, body) for body in bodies]
        during = [pool.submit(ordinary, demo_server, p) for p in prompts * 3]
        results = [f.result() for f in fuzzed]
        assert [f.result() for f in during] == before * 3
    failed = [(json.dumps(b)[:200], code, text) for b, code, text in results
              if not (code == 200 or 400 <= code < 500)]
    assert not failed, "\n".join(map(str, failed))
    refused = sum(400 <= code < 500 for _, code, _ in results)
    assert refused > len(results) / 2, refused  # the values are mostly bad: most refused
    assert [ordinary(demo_server, p) for p in prompts] == before
