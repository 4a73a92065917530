"""Self-check and stats of the freely phrased training generator (scripts/demo_phrasing.py):
validate() over 20000 examples, sentence shapes and words per schema, where the integer sits, word counts,
lowercase and made-up shares, the time for 40000 examples, and 30 samples. Seconds, CPU only:
    ./dev python scripts/demo_phrasing_stats.py
"""

import collections
import random
import re
import time

import demo_phrasing as dp
import demo_phrasing_values as dv


def number_position(example: dict) -> float:
    """Where the integer sits among the words: 0 first, 1 last."""
    words = dp.shape(example).split()
    field = next(f for f in example["record"] if f in dp.RANGES)
    return next(i for i, w in enumerate(words) if f"<{field}>" in w) / max(1, len(words) - 1)


def made_up_share(examples: list[dict]) -> float:
    """Share of string values with a word no list holds (a made-up word)."""
    lists = [*dv.CITIES, *dv.COMPANIES, *dv.COMPANY_WORDS, *dv.COMPANY_SUFFIXES, *dv.LEGAL, *dv.SAINTS,
             *dv.ROLES, *dv.SENIORITY, *dv.DEPARTMENTS, *dv.COLORS, *dv.BRANDS, *dv.LINES, *dv.MODELS, *dv.NOUNS,
             *(name for firsts, lasts in dv.NAMES.values() for name in firsts + lasts),
             *(re.sub(r"\{\w*\}", " ", t) for t in dv.INSTITUTIONS + dv.DEPT_ROLES + dv.MADE_UP_CITY),
             "specialist technician officer operator manager Gen"]
    known = {word.lower() for item in lists for word in re.split(r"[ -]", item)}
    strings = [v for e in examples for v in e["record"].values() if isinstance(v, str)]
    return sum(any(w.lower() not in known and not re.fullmatch(r"[a-z]*-?\d+", w.lower()) for w in re.split(r"[ -]", v))
               for v in strings) / len(strings)


def main():
    start = time.perf_counter()
    dp.free_dataset(40000, seed=0)
    seconds = time.perf_counter() - start
    examples, small = dp.free_dataset(20000, seed=0), dp.free_dataset(3000, seed=0)
    bad = [(e["request"], p) for e in examples if (p := dp.validate(e))]
    print(f"40000 examples in {seconds:.1f} s; examples with problems, of 20000: {len(bad)}", *bad[:5], sep="\n")
    for schema in dp.FIELDS:
        group = [e for e in examples if e["schema"] == schema]
        shapes = collections.Counter(dp.shape(e) for e in group)
        core = {re.sub(r"[^a-z<>]+", " ", s.lower()).strip() for s in shapes}  # case and punctuation aside
        fifths = collections.Counter(min(4, int(number_position(e) * 5)) for e in group)
        words = {w for s in shapes for w in re.findall(r"[a-z']+", re.sub(r"<\w+>", " ", s).lower())}
        print(f"{schema}: {len(group)} examples, {len(dp.TEMPLATES[schema])} templates, {len(shapes)} shapes "
              f"({len(core)} ignoring case and punctuation; "
              f"{len({dp.shape(e) for e in small if e['schema'] == schema})} in free_dataset(3000)), "
              f"{len(words)} distinct words outside the values; "
              f"integer by fifths of the sentence {[fifths[i] for i in range(5)]}; "
              f"most common shape {shapes.most_common(1)[0]}")
    words = collections.Counter(len(e["request"].split()) // 5 * 5 for e in examples)
    print("words (bucket from: count):", dict(sorted(words.items())),
          f"min {min(len(e['request'].split()) for e in examples)}, "
          f"max {max(len(e['request'].split()) for e in examples)}")
    strings = [v for e in examples for v in e["record"].values() if isinstance(v, str)]
    lowercase = sum(e["request"] == e["request"].lower() for e in examples) / len(examples)
    print(f"all-lowercase requests {lowercase:.1%}; string values with a made-up word "
          f"{made_up_share(examples):.1%}; distinct string values {len(set(strings))} of {len(strings)}")
    for e in random.Random(1).sample(examples, 30):
        print(f"{e['request']}\n    -> {e['answer']}")


if __name__ == "__main__":
    main()
