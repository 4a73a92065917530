"""Record values and framing words for the phrasing generator (demo_phrasing.py).

The values are data (demo_phrasing_values.json): names from ~45 languages in
Latin script (particles, hyphens, apostrophes, initials), ~540 cities,
companies, institutions and legal forms, roles, product brands, lines, model
words and nouns, colors, request frames and fillers. Here: how a record is drawn
from them, with made-up words (MADE_UP of string values) so that the model
learns to copy spans rather than recall them.
"""

import json
import random
import re
from pathlib import Path

from demo_data import made_up_word

MADE_UP = 0.3  # share of string values that are made-up words
FIELDS = {"person": ("name", "age", "city"), "product": ("product", "color", "price"),
          "employee": ("name", "role", "company", "years")}
RANGES = {"age": (18, 90), "price": (5, 9999), "years": (1, 40)}

_DATA = json.loads((Path(__file__).parent / "demo_phrasing_values.json").read_text())
NAMES = {lang: tuple(names) for lang, names in _DATA["NAMES"].items()}  # (firsts, surnames)
SURNAME_FIRST = set(_DATA["SURNAME_FIRST"])  # sometimes: "Park Jae-won", "Nagy Réka"
CITIES, MADE_UP_CITY = _DATA["CITIES"], _DATA["MADE_UP_CITY"]
COMPANIES, COMPANY_WORDS = _DATA["COMPANIES"], _DATA["COMPANY_WORDS"]
COMPANY_SUFFIXES, LEGAL, SAINTS = _DATA["COMPANY_SUFFIXES"], _DATA["LEGAL"], _DATA["SAINTS"]
# {w}: a word, {s}: a surname, {c}: a city, {t}: a saint, {x}: a suffix, {l}: a legal form
INSTITUTIONS = _DATA["INSTITUTIONS"]
DEPARTMENTS, ROLES, SENIORITY = _DATA["DEPARTMENTS"], _DATA["ROLES"], _DATA["SENIORITY"]
DEPT_ROLES, COLORS = _DATA["DEPT_ROLES"], _DATA["COLORS"]
COLOR_RE = re.compile(r"(?<![\w-])(%s)(?![\w-])" % "|".join(map(re.escape, sorted(COLORS, key=len)[::-1])))
BRANDS, LINES, MODELS, NOUNS = _DATA["BRANDS"], _DATA["LINES"], _DATA["MODELS"], _DATA["NOUNS"]
PLURAL = tuple(_DATA["PLURAL"])
PREFIXES, OPENERS, FRAMES, KEYS = _DATA["PREFIXES"], _DATA["OPENERS"], _DATA["FRAMES"], _DATA["KEYS"]
MONEY, SUFFIXES, CONTEXT = _DATA["MONEY"], _DATA["SUFFIXES"], _DATA["CONTEXT"]
PREDICATES, PRONOUNS = _DATA["PREDICATES"], _DATA["PRONOUNS"]
UNWANTED = re.compile(r"^(four|five|nine|zero|seven|tene)s?$|rape|nazi|kike|pedo")  # numbers, slurs


# --- values ---------------------------------------------------------------------------------
def made_up(rng: random.Random, capitalized: bool) -> str:
    word = made_up_word(rng, capitalized)
    if len(word) < 4 or UNWANTED.search(word.lower()):  # short ones clash with "to", "so"
        return made_up(rng, capitalized)
    if rng.random() < 0.15:  # an accent to copy: "Brivéla"
        i = rng.randrange(len(word))
        word = word[:i] + {"a": "á", "e": "é", "o": "ö", "u": "ü", "i": "í"}.get(word[i], word[i]) + word[i + 1:]
    return word


def _title(text):
    return " ".join(w if w.isupper() or w in ("of", "and") else w[0].upper() + w[1:] for w in text.split())


def _surname(rng):
    return rng.choice(rng.choice(list(NAMES.values()))[1])


def name(rng: random.Random) -> str:
    if rng.random() < MADE_UP:
        return " ".join(made_up(rng, True) for _ in range(rng.choice([1, 2, 2, 2])))
    lang = rng.choice(sorted(NAMES))
    (firsts, lasts), r = NAMES[lang], rng.random()
    first, last = rng.choice(firsts), rng.choice(lasts)
    if r < 0.12:
        return first
    if r < 0.16:  # initials, as in forms: "J. Smith", "Amara K. Singh"
        return rng.choice([f"{first[0]}. {last}", f"{first} {rng.choice('ABCDEFGHJKLMNPRSTW')}. {last}"])
    if r < 0.2 and " " not in last:
        return f"{first} {last}-{rng.choice([n for n in lasts if ' ' not in n and n != last] or [last])}"
    if r < 0.82:
        return f"{last} {first}" if lang in SURNAME_FIRST and rng.random() < 0.3 else f"{first} {last}"
    double = lang in ("es", "pt")  # two surnames (Spanish, Portuguese) or two given names
    second = rng.choice([n for n in (lasts if double else firsts) if n not in (first, last)])
    out = f"{first} {last} {second}" if double else f"{first} {second} {last}"
    return out if len(out.split()) <= 5 else f"{first} {last}"


def city(rng: random.Random) -> str:
    if rng.random() < MADE_UP:
        return rng.choice(MADE_UP_CITY).format(made_up(rng, True))
    return rng.choice(CITIES)


def company(rng: random.Random) -> str:
    if rng.random() < MADE_UP:
        word = made_up(rng, True)
        return rng.choice([word, word, word + rng.choice(["ly", "ify", "io", "ex", "ora", "Tech", "Labs"]),
                           f"{word} {rng.choice(COMPANY_SUFFIXES)}", f"{word} {rng.choice(LEGAL)}", f"{word} & Co."])
    if rng.random() < 0.25:
        return rng.choice(COMPANIES)
    w, w2 = rng.sample(COMPANY_WORDS, 2)
    out = rng.choice(INSTITUTIONS).format(w=w, w2=w2, s=_surname(rng), c=city(rng), t=rng.choice(SAINTS),
                                          x=rng.choice(COMPANY_SUFFIXES), l=rng.choice(LEGAL))
    return out if len(out.split()) <= 5 else company(rng)


def role(rng: random.Random) -> str:
    if rng.random() < MADE_UP:
        out = made_up(rng, False) + rng.choice(["", "", " specialist", " technician", " officer", " operator",
                                                " manager", "ist"])
    elif rng.random() < 0.12:
        out = rng.choice(DEPT_ROLES).format(d=rng.choice(DEPARTMENTS))
    else:
        out = rng.choice(ROLES)
        if rng.random() < 0.2 and len(out.split()) < 3 and not out.isupper():
            out = f"{rng.choice(SENIORITY)} {out}"
    return _title(out) if rng.random() < 0.12 else out  # "Senior Data Analyst", as in signatures


def _code(rng):
    """A model code: "X2", "KX-200", "3000", "Pro 14", "Mk II", "V15"."""
    n, letters = rng.randint(1, 99), "XSZVGKMRTAEPQ"
    return rng.choice([f"{rng.choice(letters)}{n}", f"{rng.choice(letters)}{rng.choice(letters)}-{n}0",
                       f"{rng.randint(1, 9)}000", f"{rng.randint(1, 9)}00", str(rng.randint(2, 12)),
                       f"{rng.choice(MODELS)} {rng.randint(2, 16)}", f"{rng.choice(letters)}{n} Pro",
                       f"Gen {rng.randint(2, 5)}", f"v{rng.randint(2, 9)}", rng.choice(MODELS), rng.choice(MODELS)])


def product(rng: random.Random) -> str:
    """A noun ("standing desk"), brand + noun, brand + model code [+ noun], brand + line + noun."""
    noun, r = made_up(rng, False) if rng.random() < 0.1 else rng.choice(NOUNS), rng.random()
    if r < 0.15:
        return noun
    brand = rng.choice([made_up(rng, True), made_up(rng, True) + rng.choice(["ix", "o", "Tech", "ware"]),
                        rng.choice(BRANDS), rng.choice(BRANDS)])
    if r < 0.35:
        return f"{brand} {noun}"
    if r < 0.45:
        return f"{brand} {rng.choice(LINES)} {noun}"
    if r < 0.57:  # just brand and model: "Zenith X5"
        return f"{brand} {_code(rng)}"
    out = f"{brand} {rng.choice(LINES) + ' ' if r > 0.93 else ''}{_code(rng)} {noun}"
    return out if len(out.split()) <= 5 else f"{brand} {noun}"


def color(rng: random.Random) -> str:
    if rng.random() < MADE_UP / 2:
        return made_up(rng, False)
    out = rng.choice(COLORS)
    return _title(out) if rng.random() < 0.08 else out  # "Midnight Blue", as in listings


def values(schema: str, rng: random.Random) -> dict:
    """A random record of `schema`, fields in FIELDS's order."""
    ints = {f: rng.randint(*RANGES[f]) for f in FIELDS[schema] if f in RANGES}
    if schema == "product" and rng.random() < 0.7:  # most prices are everyday ones
        ints["price"] = rng.randint(5, 2000)
    if schema == "employee" and rng.random() < 0.6:  # most tenures are short
        ints["years"] = rng.randint(1, 15)
    make = {"name": name, "city": city, "company": company, "role": role, "product": product, "color": color}
    return {f: ints[f] if f in ints else make[f](rng) for f in FIELDS[schema]}
