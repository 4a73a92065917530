"""The demo's training-data generators (scripts/demo_phrasing.py, scripts/demo_data.py): every
freely phrased example keeps the conventions, the output is seeded, the phrasing varies, and the
held-out sets the benchmarks read (benchmarks/data/) are the generator's. No model; seconds."""

import collections
import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))  # the generators live there

from demo_phrasing import FIELDS, RANGES, free_dataset, shape, validate  # noqa: E402

NUM = 3000
# Per schema in free_dataset(3000) (~1000 examples each), seeds 0-2 measured: 947-1046 distinct
# shapes, 284-327 distinct words outside the values (the generator before: 870-1004 and 105-125).
MIN_SHAPES, MIN_WORDS = 880, 240
# The issue's examples: they are in the frozen evaluation set, so training never shows them.
ISSUE_VALUES = ["St. Mary Hospital", "Aurora X2", "Zorbix 3000", "Kitchenly", "Maria Gonzalez", "Priya", "Initech",
                "Globex", "Hooli"]


@pytest.fixture(scope="module")
def examples():
    return free_dataset(NUM, seed=0)


def test_every_example_keeps_the_conventions(examples):
    assert len(examples) == NUM
    assert len({e["request"] for e in examples}) == NUM  # distinct requests
    problems = [(e["request"], p) for e in examples if (p := validate(e))]
    assert not problems, problems[:5]
    for e in examples:
        assert set(e) == {"schema", "request", "record", "answer"}
        assert json.loads(e["answer"]) == e["record"]


def test_validate_finds_broken_examples():
    record = {"name": "Maria Gonzalez", "role": "nurse", "company": "St. Mary Hospital", "years": 12}
    good = {"schema": "employee", "answer": json.dumps(record), "record": record,
            "request": "Maria Gonzalez is a nurse at St. Mary Hospital and has worked there for 12 years"}
    assert validate(good) == []
    broken = [
        {**good, "request": good["request"].replace("12", "twelve")},  # the integer is missing
        {**good, "request": good["request"] + " and 3 cats"},  # another number
        {**good, "request": good["request"].replace("a nurse", "a nurse (nurse)")},  # a value twice
        {**good, "request": good["request"].replace("Maria", "maria")},  # not verbatim
        {**good, "answer": json.dumps({**record, "years": 13})},
        {**good, "record": {**record, "role": "a nurse"}, "answer": json.dumps({**record, "role": "a nurse"})},
    ]
    for example in broken:
        assert validate(example), example["request"]


def test_validate_allows_digits_only_inside_the_product():
    record = {"product": "Zenith X5 Pro kettle", "color": "navy blue", "price": 49}
    good = {"schema": "product", "answer": json.dumps(record), "record": record,
            "request": "Selling my navy blue Zenith X5 Pro kettle for $49, barely used"}
    assert validate(good) == []

    def with_record(**change):
        new = {**record, **change}
        return {**good, "record": new, "answer": json.dumps(new)}
    broken = [
        {**good, "request": good["request"] + " since 2023"},  # a digit outside the product
        {**good, "request": good["request"].replace("X5", "X49")},  # the price inside the model code
        with_record(product="navy blue Zenith X5 Pro kettle", color="navy"),  # a color in the product
        with_record(product="my Zenith X5 Pro kettle"),  # a possessive
        {**good, "request": good["request"].lower()},  # all lowercase, values in capitals
    ]
    for example in broken:
        assert validate(example), example["request"]
    lowered = {k: v.lower() if isinstance(v, str) else v for k, v in record.items()}
    assert validate({**good, "request": good["request"].lower(), "record": lowered,
                     "answer": json.dumps(lowered)}) == []


def test_seeded(examples):
    assert free_dataset(NUM, seed=0) == examples
    other = free_dataset(NUM, seed=1)
    assert other != examples
    assert len({e["request"] for e in other} & {e["request"] for e in examples}) < NUM // 100


def test_schemas_in_about_equal_shares(examples):
    counts = collections.Counter(e["schema"] for e in examples)
    assert set(counts) == set(FIELDS)
    assert all(0.28 < n / NUM < 0.39 for n in counts.values()), counts


def test_many_sentence_shapes_per_schema(examples):
    for schema in FIELDS:
        shapes = {shape(e) for e in examples if e["schema"] == schema}
        words = {w for s in shapes for w in re.findall(r"[a-z']+", re.sub(r"<\w+>", " ", s).lower())}
        assert len(shapes) >= MIN_SHAPES and len(words) >= MIN_WORDS, (schema, len(shapes), len(words))


def test_many_forms_of_request(examples):
    """Questions, requests, first person, key: value lines, bare lists, the integer first."""
    shapes = [shape(e) for e in examples]
    forms = {"question": r"\?", "request": r"(?i)\b(please|can you|could you|add|log|save)\b",
             "first person": r"\b(I'm|I am|My name|I work|I've)\b", "key: value": r"(?i)\b(name|price|role) ?[:=-]",
             "bare list": r"^(\w+: )?<\w+>(,|, | \| | / | - | – |; )<\w+>(,|, | \| | / | - | – |; )<\w+>",
             "integer first": r"^\W*<(age|price|years)>", "parentheses": r"\(", "lowercase start": r"^[a-z]"}
    for form, pattern in forms.items():
        share = sum(bool(re.search(pattern, s)) for s in shapes) / len(shapes)
        assert share > 0.01, (form, share)


def test_values_from_many_languages_and_of_several_words(examples):
    strings = [v for e in examples for v in e["record"].values() if isinstance(v, str)]
    # measured: 8% with accents or other non-ASCII letters, 21% of three words or more, 76% distinct
    assert sum(not v.isascii() for v in strings) / len(strings) > 0.05
    assert sum(len(v.split()) >= 3 for v in strings) / len(strings) > 0.15
    assert len(set(strings)) > 0.6 * len(strings)


def test_never_the_values_of_the_issue(examples):
    pattern = re.compile(r"(?<!\w)(%s)(?!\w)" % "|".join(map(re.escape, ISSUE_VALUES)), re.I)
    assert not [e["request"] for e in examples if pattern.search(e["request"])]


def test_the_integer_sits_anywhere_in_the_sentence(examples):
    for schema in FIELDS:
        field = next(f for f in FIELDS[schema] if f in RANGES)
        fifths = collections.Counter()
        for e in (e for e in examples if e["schema"] == schema):
            words = shape(e).split()
            index = next(i for i, w in enumerate(words) if f"<{field}>" in w)
            fifths[min(4, 5 * index // len(words))] += 1
        total = sum(fifths.values())
        assert len(fifths) >= 3, (schema, fifths)
        assert fifths[4] < 0.7 * total and fifths[0] + fifths[1] > 0.1 * total, (schema, fifths)


def test_some_requests_are_all_lowercase(examples):
    lowercase = [e for e in examples if e["request"] == e["request"].lower()]
    assert 0.04 < len(lowercase) / NUM < 0.2


def test_the_frozen_held_out_sets_are_the_generators():
    import write_demo_sets
    from tpu_models.benchmarks import demo_sets
    assert json.loads(demo_sets.TEMPLATE_HELD_OUT.read_text()) == write_demo_sets.document()
    assert demo_sets.held_out(5, novel=True) == write_demo_sets.held_out(5, novel=True)
