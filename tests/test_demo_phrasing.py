"""The freely phrased training generator (benchmarks/demo_phrasing.py): every example keeps the
conventions, the output is seeded, and the phrasing varies. No model; well under a second."""

import collections
import json

import pytest

from tpu_models.benchmarks.demo_phrasing import FIELDS, RANGES, free_dataset, shape, validate

NUM = 3000
MIN_SHAPES = 720  # distinct sentence shapes per schema in free_dataset(3000): ~900-960 measured


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
        assert len(shapes) >= MIN_SHAPES, (schema, len(shapes))


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
