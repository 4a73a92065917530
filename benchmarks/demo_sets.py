"""The embedded demo's evaluation sets, read from data (benchmarks/data/).

- `held_out(num, novel=False)`: template sentences the training set never
  contains; `novel`: every string value a made-up word training never showed
  (frozen from scripts/demo_data.py by scripts/write_demo_sets.py);
- `free_held_out()`: hand-written, freely phrased requests, never used for
  training or selection (FREE_DEV: a set written apart, for model selection);
- `json_schema(schema)`: a record type's JSON Schema, for guided decoding.
"""

import functools
import json
from pathlib import Path

DATA = Path(__file__).parent / "data"
TEMPLATE_HELD_OUT = DATA / "demo_template_held_out.json"
FREE_HELD_OUT = DATA / "demo_free_held_out.json"
FREE_DEV = DATA / "demo_free_dev.json"


@functools.cache
def _templates() -> dict:
    return json.loads(TEMPLATE_HELD_OUT.read_text())


def held_out(num: int, novel: bool = False) -> list[dict]:
    examples = _templates()["novel" if novel else "familiar"]
    if num > len(examples):
        raise ValueError(f"{num} held-out examples asked for, {TEMPLATE_HELD_OUT} has "
                         f"{len(examples)} (scripts/write_demo_sets.py writes more)")
    return [dict(e) for e in examples[:num]]


def free_held_out(path: Path = FREE_HELD_OUT) -> list[dict]:
    """Each hand-written example with its JSON answer."""
    examples = json.loads(path.read_text())["examples"]
    return [{**e, "answer": json.dumps(e["record"])} for e in examples]


def field_types(schema: str) -> dict[str, str]:
    """Field -> "integer" or "string", in the record's order."""
    return _templates()["field_types"][schema]


def json_schema(schema: str) -> dict:
    """JSON Schema of one record type (for guided decoding)."""
    props = {field: {"type": kind} for field, kind in field_types(schema).items()}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}
