"""Freezes the demo's template held-out sets as data for the benchmarks and tests.

    ./dev python scripts/write_demo_sets.py

Writes benchmarks/data/demo_template_held_out.json: SIZE familiar and SIZE novel
sentences from demo_data.held_out (any shorter set is a prefix of these), and
each schema's field types. tests/test_demo_phrasing.py checks the file against
the generator.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from demo_data import SCHEMAS, held_out  # noqa: E402

SIZE = 512
OUT = Path(__file__).parents[1] / "benchmarks" / "data" / "demo_template_held_out.json"


def document() -> dict:
    types = {schema: {field: "integer" if isinstance(values, tuple) else "string"
                      for field, values in spec["fields"].items()}
             for schema, spec in SCHEMAS.items()}
    return {"about": "scripts/write_demo_sets.py: demo_data.held_out(512), with and without "
                     "novel=True", "field_types": types,
            "familiar": held_out(SIZE), "novel": held_out(SIZE, novel=True)}


if __name__ == "__main__":
    OUT.write_text(json.dumps(document(), indent=0, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")
