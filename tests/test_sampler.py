"""The sampler through the served engine (tpu_models/adapt/sampling.py): its
distribution equals the one computed from transformers' logits by the definition
of each parameter (chi-square), seeds reproduce and depend on the seed alone, and
logprobs of every kind equal transformers' log-softmax; on both architectures."""

import concurrent.futures
import json

import numpy as np
import pytest
import requests
from scipy import stats

from tests.tiny import Reference, make_gemma3, make_qwen3
from tpu_models.harness.serve_process import Server, launched

pytestmark = pytest.mark.e2e

SAMPLES = 20_000  # per case, all of one position
PROMPT = [7, 41, 150, 9, 77, 203]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{"qwen3": (server, reference), "gemma3": (...)}, both starting at once."""
    root = tmp_path_factory.mktemp("sampler")
    models = {"qwen3": make_qwen3(root / "qwen3"), "gemma3": make_gemma3(root / "gemma3")}
    # A second end-of-sequence id, a token Gemma 3's greedy reply reaches (ignore_eos).
    reply = Reference(models["gemma3"]).greedy(PROMPT, 24)
    stop_at = next(i for i in range(6, 24) if reply[i] not in reply[:i])
    config = json.loads((models["gemma3"] / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], reply[stop_at]]
    (models["gemma3"] / "generation_config.json").write_text(json.dumps(config))
    servers = {name: Server(path, "--max-model-len", "256", "--max-num-seqs", "512",
                            "--max-num-batched-tokens", "4096", "--max-logprobs", "20",
                            # 512 requests of a block or two at a time; the host's default
                            # budget (4 GiB each) cost this file 9% more CPU.
                            "--kv-cache-memory-bytes", str(256 << 20),
                            log=root / f"{name}.log")
               for name, path in models.items()}
    with launched(servers):
        for server in servers.values():
            server.start()
        yield {name: (servers[name], Reference(models[name])) for name in servers}


def model(server) -> str:
    return server.command[server.command.index("serve") + 1]  # served under its path


def complete(server, **body):
    response = requests.post(f"{server.url}/v1/completions", timeout=300,
                             json={"model": model(server), **body})
    assert response.status_code == 200, response.text[:1000]
    return response.json()


def sampled_ids(server, prompt=PROMPT, **params) -> np.ndarray:
    """SAMPLES draws of the token after `prompt`: two requests of SAMPLES / 2 choices
    each, in flight together; `seed` seeds the first (its children: seed, seed+1, ...)."""
    def draw(seed):  # token ids without logprobs: their detokenizing cost the server ~15%
        reply = complete(server, prompt=prompt, max_tokens=1, n=SAMPLES // 2,
                         return_token_ids=True, seed=seed, **params)
        return [c["token_ids"][0] for c in reply["choices"]]

    seed = params.pop("seed", None)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return np.array(sum(pool.map(draw, [seed, None]), []))


def expected(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Probabilities by vLLM's definitions, in its order: temperature, min_p (drop
    tokens under min_p times the top probability), top-k, top-p (keep a token while
    the mass above it is under top_p)."""
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    order = np.argsort(-probs)
    if top_k:
        keep[order[top_k:]] = False
    kept = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
    above = np.cumsum(kept[order]) - kept[order]
    keep[order[above >= top_p]] = False
    out = np.where(keep, probs, 0)
    return out / out.sum()


def chi_square_p(ids: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test, tokens with an expected count under 5 merged into one bin;
    a token drawn outside the support fails outright."""
    counts = np.bincount(ids, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, np.flatnonzero(counts * (probs == 0))
    want = probs * len(ids)
    big = want >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(want[big], want[~big].sum())
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    return stats.chisquare(observed, wanted).pvalue


CASES = {
    "temperature 1": {},
    "top-k 6": {"top_k": 6},
    "top-p 0.7": {"top_p": 0.7},
    # Ours (tpu-inference's sampler has none of them), half of the draws seeded.
    "min-p 0.2, logit_bias, seeded": {"min_p": 0.2, "logit_bias": "lift the 4th", "seed": 123},
    # Seeded, so ours: its top-k and top-p masks, computed only where a row asks.
    "top-k 12, top-p 0.8, seeded": {"top_k": 12, "top_p": 0.8, "seed": 7},
}


@pytest.mark.parametrize("case", CASES)
def test_sampled_distribution_is_the_reference(served, case):
    server, reference = served["qwen3"]
    params = {"temperature": 1.0, **CASES[case]}
    logits = reference.logits(PROMPT)[-1].astype(np.float64)
    if "logit_bias" in params:  # +1.5 on the 4th most likely token: added before temperature
        lifted = int(np.argsort(-logits)[3])
        params["logit_bias"] = {str(lifted): 1.5}
        logits[lifted] += 1.5
    definition = {k: v for k, v in params.items() if k not in ("seed", "logit_bias")}
    probs = expected(logits, **definition)
    # The case must exclude tokens and leave several: a mask that did nothing fails.
    assert 3 <= np.count_nonzero(probs) and (case == "temperature 1" or
                                            np.count_nonzero(probs) < len(probs) / 2)
    ids = sampled_ids(server, **params)
    assert len(ids) == SAMPLES and chi_square_p(ids, probs) >= 1e-3


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_seeded_replies_repeat_and_differ_by_seed(served, arch):
    server, _ = served[arch]

    def reply(seed, **extra):
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": seed,
                "return_tokens_as_token_ids": True, "logprobs": 0, **extra}
        return [c["logprobs"]["tokens"] for c in complete(server, **body)["choices"]]

    alone = {seed: reply(seed)[0] for seed in (1, 2, 3, 2**40 + 1)}
    assert len({tuple(r) for r in alone.values()}) == 4, alone  # seeds tell replies apart
    # The same seed again, all in flight with 8 unseeded requests: the same reply.
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        noise = [pool.submit(reply, None, max_tokens=16) for _ in range(8)]
        again = [pool.submit(reply, seed) for seed in alone]
        assert [f.result()[0] for f in again] == list(alone.values())
        assert len({tuple(f.result()[0]) for f in noise}) > 1  # unseeded ones vary
    # n=3 with seed 1: children seeded 1, 2, 3 (vLLM's rule).
    assert reply(1, n=3) == [alone[1], alone[2], alone[3]]


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_logprobs_of_every_kind_are_transformers_log_softmax(served, arch):
    server, reference = served[arch]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "return_tokens_as_token_ids": True}
    # echo: the prompt's tokens (first has none) then the reply's, top 20 each.
    choice = complete(server, **body, echo=True, logprobs=20)["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in choice["tokens"]]
    assert ids[:len(PROMPT)] == PROMPT and len(ids) == len(PROMPT) + 6
    want = reference.logits(ids).astype(np.float64)
    want = want - np.log(np.exp(want - want.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - want.max(-1, keepdims=True)
    assert choice["token_logprobs"][0] is None
    # fp32 log-softmax against transformers fp32: reduction order differs, 1e-4 on O(1) values
    got = np.array(choice["token_logprobs"][1:])
    np.testing.assert_allclose(got, want[np.arange(len(ids) - 1), ids[1:]], atol=1e-4, rtol=0)
    for position, top in enumerate(choice["top_logprobs"][1:]):
        ranked = np.argsort(-want[position])[:20]
        assert len(top) >= 20
        for token in ranked[:5]:  # clear of ties: the five best of each position
            np.testing.assert_allclose(top[f"token_id:{token}"], want[position, token],
                                       atol=1e-4, rtol=0)
    # prompt_logprobs: the same values, vLLM's own structure.
    reply = complete(server, **body, prompt_logprobs=3, logprobs=0)
    prompt_lp = reply["choices"][0]["prompt_logprobs"]
    assert prompt_lp[0] is None
    for position, entry in enumerate(prompt_lp[1:]):
        token = PROMPT[position + 1]
        assert abs(entry[str(token)]["logprob"] - want[position, token]) <= 1e-4
    # Chat's top_logprobs: values of the reply's tokens, five alternatives each.
    response = requests.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": model(server),
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
        "logprobs": True, "top_logprobs": 5})
    assert response.status_code == 200, response.text[:500]
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) >= 1 and all(len(e["top_logprobs"]) == 5 for e in content)
    assert all(e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"], abs=1e-6)
               for e in content)  # greedy: the chosen token is the most likely


def token_ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def test_stopping_parameters_follow_their_definitions(served):
    server, reference = served["qwen3"]
    tokenizer = reference_tokenizer(server)
    want = reference.greedy(PROMPT, 24)
    body = {"prompt": PROMPT, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}

    def run(**extra):
        return complete(server, **{**body, "max_tokens": 24, **extra})["choices"][0]

    choice = run(max_tokens=5)
    assert token_ids(choice) == want[:5] and choice["finish_reason"] == "length"
    # stop_token_ids: ends at the first one, which is in the output (not special).
    j = next(i for i in range(3, 24) if want[i] not in want[:i])
    choice = run(stop_token_ids=[want[j]])
    assert token_ids(choice) == want[:j + 1] and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == want[j]
    # stop strings: the text up to the first occurrence, with it if asked.
    text = tokenizer.decode(want)
    stop = tokenizer.decode(want[j:j + 2])
    cut = text.index(stop)
    assert run(stop=[stop], logprobs=None)["text"] == text[:cut]
    assert run(stop=[stop], include_stop_str_in_output=True,
               logprobs=None)["text"] == text[:cut + len(stop)]
    # repetition_detection: the first output prefix ending in a pattern of 1-4 tokens
    # repeated 3 times (vLLM's scheduler, any platform).
    long = reference.greedy(PROMPT, 120)
    end = next(n for n in range(1, 121) if any(
        n >= 3 * size and long[n - size:n] * 3 == long[n - 3 * size:n] for size in range(1, 5)))
    choice = run(max_tokens=120, repetition_detection={"max_pattern_size": 4, "min_count": 3})
    assert end < 120 and token_ids(choice) == long[:end]


def reference_tokenizer(server):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model(server))


def test_ignore_eos_runs_past_the_end_of_sequence(served):
    server, reference = served["gemma3"]
    want = reference.greedy(PROMPT, 24)
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 24, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    stopped = complete(server, **body)["choices"][0]
    stop_at = len(token_ids(stopped))
    assert stop_at < 24 and stopped["finish_reason"] == "stop"
    assert token_ids(stopped) == want[:stop_at]
    assert token_ids(complete(server, **body, ignore_eos=True)["choices"][0]) == want


def test_beam_search_keeps_the_most_likely_beams(served):
    """Beam search by its definition over transformers' log-probabilities: every
    step keeps the `width` most likely extensions of the kept beams."""
    server, reference = served["qwen3"]
    width, length = 3, 4
    beams = [(0.0, [])]
    for _ in range(length):
        grown = []
        for score, ids in beams:
            logits = reference.logits(PROMPT + ids)[-1].astype(np.float64)
            logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
            grown += [(score + logp[t], ids + [int(t)]) for t in np.argsort(-logp)[:2 * width]]
        beams = sorted(grown, key=lambda b: -b[0])[:width]
    tokenizer = reference_tokenizer(server)
    reply = complete(server, prompt=PROMPT, max_tokens=length, n=width, use_beam_search=True,
                     temperature=0)
    assert [c["text"] for c in reply["choices"]] == [tokenizer.decode(ids) for _, ids in beams]


def greedy_by_definition(reference, prompt, max_tokens, *, bias=None, allowed=None,
                         min_tokens=0, stop_ids=(), repetition_penalty=1.0,
                         frequency_penalty=0.0, presence_penalty=0.0, bad_words=(),
                         margins=None):
    """Greedy ids over transformers' logits with vLLM's definitions applied, in its
    order (v1/sample/sampler.py): only `allowed` may be chosen; a bad word's last id
    is banned where the ids before it end the output; `bias` is added, stop ids are
    masked for the first `min_tokens` tokens; then the penalties
    (model_executor/layers/utils.py): repetition over prompt and output, positive
    logits divided and others multiplied, then the output counts times the frequency
    penalty and their presence times the presence penalty, subtracted. Ends after a
    stop id. `margins` collects each step's gap between the best two logits."""
    ids = []
    while len(ids) < max_tokens:
        logits = reference.logits(prompt + ids)[-1].astype(np.float64)
        vocab = np.arange(len(logits))
        if allowed is not None:
            logits = np.where(np.isin(vocab, allowed), logits, -np.inf)
        for word in bad_words:
            before = word[:-1]
            if len(before) <= len(ids) and ids[len(ids) - len(before):] == before:
                logits[word[-1]] = -np.inf
        for token, value in (bias or {}).items():
            logits[token] += value
        if len(ids) < min_tokens:
            logits[list(stop_ids)] = -np.inf
        seen = np.isin(vocab, prompt + ids)
        logits = np.where(seen & (logits > 0), logits / repetition_penalty, logits)
        logits = np.where(seen & (logits <= 0), logits * repetition_penalty, logits)
        counts = np.bincount(ids, minlength=len(logits))[:len(logits)]
        logits = logits - frequency_penalty * counts - presence_penalty * (counts > 0)
        if margins is not None:
            top = np.sort(logits)[-2:]
            margins.append(top[1] - top[0])
        ids.append(int(np.argmax(logits)))
        if ids[-1] in stop_ids:
            break
    return ids


def test_logit_bias_and_allowed_token_ids_follow_their_definitions(served):
    server, reference = served["qwen3"]
    plain = reference.greedy(PROMPT, 8)
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    # -100 on the first greedy token and +5 on a token it would not choose.
    bias = {plain[0]: -100.0, plain[3] + 1: 5.0}
    want = greedy_by_definition(reference, PROMPT, 8, bias=bias)
    assert want != plain
    choice = complete(server, **body, logit_bias={str(k): v for k, v in bias.items()})
    assert token_ids(choice["choices"][0]) == want
    # allowed ids: none of the unrestricted reply's first three tokens.
    allowed = sorted(set(range(20, 60)) - set(plain))
    want = greedy_by_definition(reference, PROMPT, 8, allowed=allowed)
    choice = complete(server, **body, allowed_token_ids=allowed)
    assert token_ids(choice["choices"][0]) == want and set(want) <= set(allowed)
    # Sampled too: every draw is an allowed id (and the batch's other rows are not).
    sampled = complete(server, prompt=PROMPT, max_tokens=4, temperature=1.0, n=64, logprobs=0,
                       return_tokens_as_token_ids=True, allowed_token_ids=allowed[:5])
    drawn = {t for c in sampled["choices"] for t in token_ids(c)}
    assert drawn <= set(allowed[:5]) and len(drawn) > 1


def test_min_tokens_masks_the_end_of_sequence_until_reached(served):
    server, reference = served["gemma3"]
    config = json.loads((reference_dir(server) / "generation_config.json").read_text())
    stop_ids = set(config["eos_token_id"])
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 24, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    stopped = len(token_ids(complete(server, **body)["choices"][0]))
    want = greedy_by_definition(reference, PROMPT, 24, min_tokens=stopped + 2,
                                stop_ids=tuple(stop_ids))
    assert len(want) > stopped
    got = complete(server, **body, min_tokens=stopped + 2)["choices"][0]
    assert token_ids(got) == want


def reference_dir(server):
    from pathlib import Path
    return Path(model(server))


def test_skip_special_tokens_decides_whether_they_are_in_the_text(served):
    server, reference = served["qwen3"]
    tokenizer = reference_tokenizer(server)
    special = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 4, "logprobs": 0,
            "return_tokens_as_token_ids": True, "allowed_token_ids": special + [65]}
    for skip in (True, False):
        choice = complete(server, **body, skip_special_tokens=skip)["choices"][0]
        ids = token_ids(choice)
        assert set(ids) & set(special), ids  # the reply has special tokens to skip or keep
        assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=skip)


PENALTIES = {
    "repetition": {"repetition_penalty": 1.6},
    "frequency": {"frequency_penalty": 0.9},
    "presence": {"presence_penalty": 1.2},
    "all three": {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5},
}
DECISIVE = 1e-4  # served fp32 logits are within ~1e-5 of transformers' (the logprob tests' 1e-4)


def decisive_greedy(reference, prompt, max_tokens, **definition) -> list[int]:
    margins = []
    ids = greedy_by_definition(reference, prompt, max_tokens, margins=margins, **definition)
    assert min(margins) > DECISIVE, (definition, min(margins))
    return ids


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_penalties_follow_their_definitions(served, arch):
    """Each penalty alone and the three together, all in flight at once; computed on
    the device from the counts it keeps, against the definitions over transformers'
    logits."""
    server, reference = served[arch]
    plain = reference.greedy(PROMPT, 16)
    want = {case: decisive_greedy(reference, PROMPT, 16, **params)
            for case, params in PENALTIES.items()}
    assert all(ids != plain for ids in want.values()), want  # each penalty changes the reply
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 16, "logprobs": 0,
            "return_tokens_as_token_ids": True, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(len(PENALTIES)) as pool:
        got = dict(zip(PENALTIES, pool.map(
            lambda params: token_ids(complete(server, **body, **params)["choices"][0]),
            PENALTIES.values())))
    assert got == want


def bad_word_ids(tokenizer, word: str) -> list[list[int]]:
    """vLLM's ids for a bad word (SamplingParams.update_from_tokenizer): the word as
    written, and with a leading space where that is a different word of as many ids."""
    ids = [tokenizer.encode(word.lstrip(), add_special_tokens=False)]
    spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
    if spaced and spaced[0] != ids[0][0] and len(spaced) == len(ids[0]):
        ids.append(spaced)
    return ids


def test_bad_words_follow_their_definition(served):
    """Words of one and of two ids, taken from the unrestricted reply, so that each
    changes it; and one longer than the ids the device keeps gets a 400."""
    server, reference = served["qwen3"]
    tokenizer = reference_tokenizer(server)
    plain = reference.greedy(PROMPT, 16)
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 16, "logprobs": 0,
            "return_tokens_as_token_ids": True, "ignore_eos": True}
    found = {}
    for start in range(len(plain) - 1):
        for size in (1, 2):
            word = tokenizer.decode(plain[start:start + size])
            if not word.strip() or size in found:
                continue
            ids = bad_word_ids(tokenizer, word)
            if max(map(len, ids)) != size:
                continue
            margins = []
            want = greedy_by_definition(reference, PROMPT, 16, bad_words=ids, margins=margins)
            if want != plain and min(margins) > DECISIVE:
                found[size] = (word, want)
    assert set(found) == {1, 2}, found
    for word, want in found.values():
        assert token_ids(complete(server, **body, bad_words=[word])["choices"][0]) == want, word
    response = requests.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": model(server), "prompt": PROMPT, "max_tokens": 2,
        "bad_words": [tokenizer.decode(plain[:1] * 40)]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "bad_words"


def test_24_requests_in_flight_mixing_penalties_seeds_and_plain(served):
    """Prompts of 200 ids sharing a 150-id prefix, served from the prefix cache (the
    prompt's ids still count for the repetition penalty). Penalized and plain greedy
    replies are the definitions'; seeded ones are what the same seed gives alone.
    (Chunked prefill: tests/test_hybrid_kv_cache.py.)"""
    server, reference = served["gemma3"]
    rng = np.random.default_rng(11)
    prefix = rng.integers(10, reference.vocab_size, 150).tolist()
    prompts = [prefix + rng.integers(10, reference.vocab_size, 50).tolist() for _ in range(24)]
    cases = [PENALTIES[name] for name in PENALTIES] * 2 + [{}] * 8 + [{"seed": s} for s in range(8)]
    body = {"temperature": 0, "max_tokens": 10, "logprobs": 0, "return_tokens_as_token_ids": True,
            "ignore_eos": True}

    def run(prompt, params):
        extra = {"temperature": 1.0} if "seed" in params else {}
        return token_ids(complete(server, **{**body, **extra}, prompt=prompt, **params)
                         ["choices"][0])

    alone = {i: run(prompts[i], cases[i]) for i in range(16, 24)}  # the seeded ones, alone
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        got = list(pool.map(run, prompts, cases))
    for i, (prompt, params) in enumerate(zip(prompts, cases)):
        if "seed" in params:
            assert got[i] == alone[i], i
        else:
            assert got[i] == decisive_greedy(reference, prompt, 10, **params), (i, params)


def test_a_penalized_distribution_is_the_reference(served):
    """Draws under a repetition penalty (the prompt's ids, the first generated token)
    and a temperature, against the definition (chi-square); the prompt ends in its own
    likeliest continuations, so that the penalty moves much of the mass, and the draws
    must reject the unpenalized distribution."""
    server, reference = served["qwen3"]
    penalty, temperature = 2.0, 1.5
    # 8 tokens: a request of more attends through the portable kernel's prefill path,
    # one request after another (4x this test's time, at 455 requests a step).
    logits = reference.logits(PROMPT[:4])[-1].astype(np.float64)
    prompt = PROMPT[:4] + [int(t) for t in np.argsort(-logits)[:4]]
    logits = reference.logits(prompt)[-1].astype(np.float64)
    seen = np.isin(np.arange(len(logits)), prompt)
    penalized = np.where(seen, np.where(logits > 0, logits / penalty, logits * penalty), logits)
    probs, unpenalized = expected(penalized, temperature), expected(logits, temperature)
    assert np.abs(probs - unpenalized).sum() / 2 > 0.05  # total variation: the penalty matters
    ids = sampled_ids(server, prompt, temperature=temperature, repetition_penalty=penalty)
    assert chi_square_p(ids, probs) >= 1e-3
    assert chi_square_p(ids, unpenalized) < 1e-6
