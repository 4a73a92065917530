"""Synthetic requests answered in JSON: the embedded demo's training and held-out data.

Each example is a short natural-language sentence about one record and the
JSON object it describes, e.g.
    "Alice is 30 and lives in Paris" -> {"name": "Alice", "age": 30, "city": "Paris"}
over a few schemas, with several phrasings each. Half of the string values
are made-up words (random syllables), so the model learns to copy values out
of the request rather than to recall a list. Held-out examples come from
another seed and never repeat a training sentence; `held_out(novel=True)`
uses only made-up words from that seed, values training never showed.
The held-out sets the benchmarks and tests read are frozen from here as data
(benchmarks/data/, by scripts/write_demo_sets.py).
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



TRAIN_SEED, TRAIN_SIZE = 0, 40000
HELD_OUT_SEED = 1
MADE_UP_SHARE = 0.5  # of string values, in training

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "ch", "sh", "br",
          "tr", "kl"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]


def made_up_word(rng: random.Random, capitalized: bool) -> str:
    word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.3:
        word += rng.choice(["n", "r", "s", "x"])
    return word.capitalize() if capitalized else word


def sample(rng: random.Random, made_up_share: float) -> tuple[str, str, dict, str]:
    """(schema, request sentence, record, JSON answer)."""
    schema = rng.choice(sorted(SCHEMAS))
    spec = SCHEMAS[schema]
    record = {}
    for field, values in spec["fields"].items():
        if isinstance(values, tuple):
            record[field] = rng.randint(*values)
        elif rng.random() < made_up_share:
            record[field] = made_up_word(rng, capitalized=values[0][0].isupper())
        else:
            record[field] = rng.choice(values)
    request = rng.choice(spec["templates"]).format(**record)
    return schema, request, record, json.dumps(record)


def dataset(num: int, seed: int, exclude: set[str] = frozenset(),
            made_up_share: float = MADE_UP_SHARE) -> list[dict]:
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < num:
        schema, request, record, answer = sample(rng, made_up_share)
        if request in seen:
            continue
        seen.add(request)
        out.append({"schema": schema, "request": request, "record": record, "answer": answer})
    return out


def held_out(num: int, novel: bool = False) -> list[dict]:
    """Requests the training set (dataset(TRAIN_SIZE, TRAIN_SEED)) never contains;
    with `novel`, every string value is a made-up word training never showed."""
    train = dataset(TRAIN_SIZE, TRAIN_SEED)
    if not novel:
        return dataset(num, HELD_OUT_SEED, exclude={e["request"] for e in train}, made_up_share=0.0)
    known = {v for e in train for v in e["record"].values() if isinstance(v, str)}
    return [e for e in dataset(4 * num, HELD_OUT_SEED, made_up_share=1.0)
            if not known & {v for v in e["record"].values() if isinstance(v, str)}][:num]
