"""Synthetic requests answered in JSON: the embedded demo's training and held-out data.

Each example is a short natural-language sentence about one record and the
JSON object it describes, e.g.
    "Alice is 30 and lives in Paris" -> {"name": "Alice", "age": 30, "city": "Paris"}
over a few schemas, with several phrasings each. Held-out examples come from
another seed and never repeat a training sentence.
"""

import json
import random

NAMES = ["Alice", "Bob", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas",
         "Keiko", "Liam", "Maya", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Tara",
         "Umar", "Vera", "Wei", "Xenia", "Yusuf", "Zoe", "Amara", "Bruno", "Chloe", "Dmitri"]
CITIES = ["Paris", "Lima", "Tokyo", "Berlin", "Cairo", "Oslo", "Madrid", "Seoul", "Dublin",
          "Nairobi", "Lisbon", "Austin", "Quito", "Hanoi", "Prague", "Accra", "Denver", "Rome",
          "Delhi", "Sydney", "Boston", "Vienna", "Manila", "Bogota"]
PRODUCTS = ["laptop", "phone", "bicycle", "kettle", "camera", "desk", "lamp", "backpack",
            "guitar", "watch", "printer", "sofa", "drone", "blender", "tablet", "helmet"]
COLORS = ["red", "blue", "green", "black", "white", "silver", "yellow", "orange", "purple", "gray"]
COMPANIES = ["Acme", "Globex", "Initech", "Umbrella", "Hooli", "Stark", "Wayne", "Tyrell",
             "Cyberdyne", "Soylent", "Wonka", "Gringotts"]
ROLES = ["engineer", "designer", "manager", "analyst", "teacher", "nurse", "chef", "pilot",
         "writer", "lawyer"]

SCHEMAS = {
    "person": {
        "fields": {"name": NAMES, "age": (18, 90), "city": CITIES},
        "templates": [
            "{name} is {age} and lives in {city}",
            "{name}, age {age}, lives in {city}",
            "{name} lives in {city} and is {age} years old",
            "Meet {name} from {city}, who is {age}",
            "{city} is home to {name}, aged {age}",
        ],
    },
    "product": {
        "fields": {"product": PRODUCTS, "color": COLORS, "price": (5, 2000)},
        "templates": [
            "A {color} {product} that costs {price} dollars",
            "The {product} is {color} and sells for {price}",
            "Buy a {color} {product} for {price}",
            "{product} in {color}, priced at {price}",
        ],
    },
    "employee": {
        "fields": {"name": NAMES, "role": ROLES, "company": COMPANIES, "years": (1, 40)},
        "templates": [
            "{name} works as a {role} at {company} for {years} years",
            "{name} has been a {role} at {company} for {years} years",
            "At {company}, {name} is a {role} with {years} years there",
        ],
    },
}



TRAIN_SEED, TRAIN_SIZE = 0, 30000
HELD_OUT_SEED = 1


def sample(rng: random.Random) -> tuple[str, str, dict, str]:
    """(schema, request sentence, record, JSON answer)."""
    schema = rng.choice(sorted(SCHEMAS))
    spec = SCHEMAS[schema]
    record = {}
    for field, values in spec["fields"].items():
        record[field] = rng.randint(*values) if isinstance(values, tuple) else rng.choice(values)
    request = rng.choice(spec["templates"]).format(**record)
    return schema, request, record, json.dumps(record)


def dataset(num: int, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < num:
        schema, request, record, answer = sample(rng)
        if request in seen:
            continue
        seen.add(request)
        out.append({"schema": schema, "request": request, "record": record, "answer": answer})
    return out


def held_out(num: int) -> list[dict]:
    """Requests the training set (dataset(TRAIN_SIZE, TRAIN_SEED)) never contains."""
    train = {e["request"] for e in dataset(TRAIN_SIZE, TRAIN_SEED)}
    return dataset(num, HELD_OUT_SEED, exclude=train)


def json_schema(schema: str) -> dict:
    """JSON Schema of one record type (for guided decoding)."""
    props = {field: {"type": "integer"} if isinstance(values, tuple) else {"type": "string"}
             for field, values in SCHEMAS[schema]["fields"].items()}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}
