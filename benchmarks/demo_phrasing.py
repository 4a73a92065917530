"""Freely phrased training requests for the embedded demo (demo_data.py's three schemas), e.g.
"Wanjiru Kamau has been a pharmacist at Kigali General Hospital for 9 years, believe it or not" ->
{"name": "Wanjiru Kamau", "role": "pharmacist", "company": "Kigali General Hospital", "years": 9}.

A bracket grammar over ~20 template lines per schema, each with many variants, plus filler
prefixes, context clauses that name no value, punctuation and lowercase variants. Values: names
and cities from many languages, generated companies and products, and made-up words (~30%) so
that the model learns to copy rather than recall. `validate` checks the conventions. Nothing here
reads the frozen evaluation set, nor names the issue's examples it holds (St. Mary Hospital, Aurora
X2). Stats and samples: ./dev python scripts/demo_phrasing_stats.py
"""

import json
import random
import re

from tpu_models.benchmarks.demo_data import made_up_word

MADE_UP = 0.3  # share of string values that are made-up words
LOWERCASE = 0.08  # share of all-lowercase requests (the record's strings lowercased too)
KEY_VALUE = 0.12  # share of "name: X; age: Y; city: Z" requests
FIELDS = {"person": ("name", "age", "city"), "product": ("product", "color", "price"),
          "employee": ("name", "role", "company", "years")}
RANGES = {"age": (18, 90), "price": (5, 9999), "years": (1, 40)}

# --- values ---------------------------------------------------------------------------------
# "language: first names | surnames": thousands of combinations.
NAMES = {lang: (firsts.split(), lasts.split())
         for lang, firsts, lasts in (re.split(r"\s*[:|]\s*", line) for line in """
es: José María Lucía Alejandro Sofía Carmen Javier Valentina Diego Camila | García Gonzalez Rodríguez López Pérez Torres
pt: João Ana Luís Beatriz Tiago Mariana Gonçalo Inês Larissa Thiago | Silva Santos Oliveira Souza Costa Ferreira Rocha
ng: Adebayo Chiamaka Oluwaseun Ngozi Emeka Funmilayo Chinedu Yetunde Obinna | Okafor Adeyemi Okonkwo Balogun Eze Nwosu
vi: Linh Minh Thảo Hương Đức Quang Trang Bảo Tuấn Phương | Nguyễn Nguyen Tran Trần Pham Hoang Vu Dang Bui
pl: Łukasz Katarzyna Piotr Agnieszka Tomasz Małgorzata Zofia Wojciech | Kowalski Nowak Wiśniewska Wójcik Dąbrowski
hi: Aarav Diya Rohan Ananya Vikram Sneha Arjun Kavya Rahul Deepika | Sharma Patel Gupta Singh Reddy Iyer Nair Mehta
ar: Ahmed Fatima Omar Layla Yusuf Amira Khalid Noor Hassan Zainab | Al-Sayed Haddad Mansour Khalil Nasser El-Amin Aziz
fi: Aino Eero Onni Helmi Väinö Sanna Juha Kaisa Mikko Ilona | Virtanen Korhonen Mäkinen Nieminen Hämäläinen Järvinen
ko: Ji-woo Min-jun Seo-yeon Do-hyun Hye-jin Jae-won Soo-ah Eun-ji Hyun-woo | Kim Lee Park Choi Jung Kang Yoon
ja: Haruto Yui Sota Aoi Hina Takumi Sakura Kenji Yuki Daichi | Sato Suzuki Takahashi Tanaka Yamamoto Nakamura
tr: Emre Elif Mehmet Zeynep Burak Ayşe Selin Çağrı Şeyma Oğuz Merve | Yılmaz Kaya Demir Şahin Çelik Öztürk Aydın
ga: Aoife Siobhán Niamh Cian Oisín Saoirse Ciarán Róisín Eoin | O'Brien Murphy Kelly O'Sullivan Byrne Walsh Doyle
de: Lukas Anna Jonas Lena Felix Marie Hannah Jürgen Sabine Matthias Jörg | Müller Schmidt Fischer Weber Becker Köhler
sw: Amani Baraka Zawadi Juma Neema Imani Jabari Rehema Wanjiru Achieng | Mwangi Otieno Kamau Njoroge Mutua Kimani
zh: Wei Fang Jing Lei Xiaoming Mei Hao Yan Jun Xiu Zhen | Wang Zhang Liu Chen Yang Huang Zhao Zhou
en: Tom Sarah James Emily Michael Olivia Daniel Grace Ethan Chloe Zoë | Smith Johnson Taylor Wilson Clark Hughes
fr: Élodie Chloé Théo Mathis Léa Hélène François Amélie Gaël | Dubois Lefèvre Moreau Laurent Girard Rousseau
""".strip().splitlines())}
SURNAME_FIRST = {"vi", "ko", "ja", "zh"}  # a third of the time: "Park Jae-won"

CITIES = [item.strip() for item in """Lagos|Nairobi|Accra|Cairo|Casablanca|Addis Ababa|Dar es Salaam|Kampala|
Dakar|Cape Town|Johannesburg|Kinshasa|Tunis|Kigali|Abuja|Port Harcourt|Luanda|Ho Chi Minh City|Hanoi|Tokyo|
Osaka|Seoul|Busan|Beijing|Shanghai|Shenzhen|Mumbai|New Delhi|Bangalore|Kolkata|Karachi|Dhaka|Jakarta|Manila|
Bangkok|Kuala Lumpur|Singapore|Istanbul|Ankara|Tehran|Riyadh|Dubai|Abu Dhabi|Tel Aviv|Amman|Beirut|Kathmandu|
Taipei|Hong Kong|Ulaanbaatar|Paris|Berlin|Munich|Kraków|Warsaw|Helsinki|Dublin|Cork|Lisbon|Porto|Madrid|
Barcelona|Rome|Milan|Vienna|Prague|Budapest|Zürich|Amsterdam|Brussels|Copenhagen|Oslo|Stockholm|Reykjavík|
Athens|Bucharest|Kyiv|Edinburgh|Manchester|London|Frankfurt am Main|Saint Petersburg|New York City|
Los Angeles|San Francisco|Salt Lake City|Mexico City|Guadalajara|Toronto|Montréal|Vancouver|Chicago|Houston|
Buenos Aires|Rio de Janeiro|São Paulo|Bogotá|Medellín|Lima|Santiago|Quito|Montevideo|La Paz|Havana|
Panama City|Kingston|Sydney|Melbourne|Auckland|Wellington|Perth|Brisbane|Suva|Port Moresby|Honolulu""".split("|")]
COMPANIES = [item.strip() for item in """Google|Siemens|Samsung|Tata Consultancy Services|Banco Santander|
Nokia|Toyota|Unilever|Safaricom|Infosys|Petrobras|Dangote Group|Mercado Libre|Deutsche Bahn|Accenture|
Spotify|Shopify|Airbus|Nestlé|IKEA|Flutterwave|Grab|Ryanair|Mayo Clinic|Red Cross""".split("|")]
COMPANY_WORDS = ("Blue Northwind Summit Pioneer Evergreen Bright Atlas Cedar Maple River Falcon "
                 "Horizon Keystone Redwood Quantum Apex Lighthouse Golden Iron Oak Coastal").split()
COMPANY_SUFFIXES = ("Logistics Labs Systems Solutions Bank Bakery Consulting Media Foods Analytics Health "
                    "Motors Studios Partners Group Technologies Capital Energy Pharma Clinic").split()
ROLES = [item.strip() for item in """nurse|software engineer|data analyst|teacher|chef|accountant|pharmacist|
electrician|graphic designer|product manager|sales associate|lawyer|dentist|mechanic|civil engineer|
architect|barista|cashier|marketing manager|HR manager|UX designer|data scientist|web developer|
project manager|truck driver|paralegal|receptionist|security guard|research scientist|lab technician|
financial analyst|customer support agent|head chef|social worker|physiotherapist|translator|librarian|CEO|
CTO|operations director|warehouse supervisor|flight attendant|pilot|veterinarian|plumber|carpenter|
photographer|editor|surgeon|midwife|cook|driver""".split("|")]
SENIORITY = ["senior", "junior", "lead", "chief", "assistant", "principal"]
COLORS = [item.strip() for item in """red|blue|green|black|white|silver|yellow|orange|purple|gray|grey|pink|
beige|navy blue|rose gold|matte black|sky blue|forest green|dark gray|light blue|burgundy|teal|charcoal|
ivory|olive green|space gray|midnight blue|cream|coral|turquoise|gold|bronze|lavender|mint green|crimson|
brown|khaki|off-white|jet black|pearl white|cherry red|navy""".split("|")]
COLOR_WORDS = {w for c in COLORS for w in c.split()}
BRANDS = ("Nimbus Vortex Zenith Orion Kestrel Solaris Lumina Titan Nova Bosch Sony Philips Dyson "
          "Xiaomi Lenovo Canon Garmin Logitech Anker Tefal Samsung Apple Nikon Brompton").split()
MODELS = "Pro Mini Max Ultra Air Plus Lite GT SE One".split() + ["Pro Max", "Series 7"]
NOUNS = [item.strip() for item in """headphones|earbuds|sneakers|running shoes|sunglasses|blender|laptop|
phone|smartphone|bicycle|electric scooter|standing desk|office chair|coffee maker|espresso machine|backpack|
wristwatch|smartwatch|tablet|camera|drone|air fryer|vacuum cleaner|toaster|kettle|desk lamp|gaming mouse|
mechanical keyboard|monitor|printer|sofa|rice cooker|hair dryer|yoga mat|water bottle|tent|sleeping bag|
guitar|suitcase|rain jacket|hoodie|helmet|router|speaker|projector|microwave""".split("|")]
PLURAL = ("headphones", "earbuds", "sneakers", "shoes", "sunglasses")  # "are", "a pair of"

def _made_up(rng, capitalized):
    word = made_up_word(rng, capitalized)
    return word if len(word) >= 4 else _made_up(rng, capitalized)  # short ones clash with "to", "so"


def _name(rng):
    if rng.random() < MADE_UP:
        return " ".join(_made_up(rng, True) for _ in range(rng.choice([1, 2, 2])))
    lang = rng.choice(sorted(NAMES))
    (firsts, lasts), r = NAMES[lang], rng.random()
    first, last = rng.choice(firsts), rng.choice(lasts)
    if r < 0.15:
        return first
    if r < 0.85:
        return f"{last} {first}" if lang in SURNAME_FIRST and rng.random() < 0.3 else f"{first} {last}"
    double = lang in ("es", "pt")  # three words: two surnames (Spanish, Portuguese) or two given names
    second = rng.choice([n for n in (lasts if double else firsts) if n not in (first, last)])
    return f"{first} {last} {second}" if double else f"{first} {second} {last}"


def _city(rng):
    if rng.random() < MADE_UP:
        return rng.choice(["{}", "{}", "{} City", "Port {}", "San {}", "New {}"]).format(_made_up(rng, True))
    return rng.choice(CITIES)


def _company(rng):
    if rng.random() < MADE_UP:
        return _made_up(rng, True) + rng.choice(["", "", " " + rng.choice(COMPANY_SUFFIXES)])
    word, suffix, city = rng.choice(COMPANY_WORDS), rng.choice(COMPANY_SUFFIXES), rng.choice(CITIES)
    surname, saint = rng.choice(rng.choice(list(NAMES.values()))[1]), rng.choice(["Luke", "Anne", "Jude", "Vincent"])
    word2 = rng.choice([w for w in COMPANY_WORDS if w != word])
    name = rng.choice([rng.choice(COMPANIES), f"{word} {suffix}", f"{word} {suffix}", f"{word} {word2} {suffix}",
                       f"{surname} & Sons", f"{surname} & Partners", f"{surname} {suffix}", f"{city} Hospital",
                       f"{city} General Hospital", f"St. {saint} Hospital", f"University of {city}"])
    return name if len(name.split()) <= 3 else _company(rng)


def _role(rng):
    if rng.random() < MADE_UP:
        return _made_up(rng, False) + rng.choice(["", "", " specialist", " technician", " officer"])
    role = rng.choice(ROLES)
    if rng.random() < 0.2 and len(role.split()) < 3 and not role.isupper():
        role = f"{rng.choice(SENIORITY)} {role}"
    return role


def _product(rng):
    """A noun ("standing desk"), or brand + noun, or brand + model code + noun."""
    noun, r = _made_up(rng, False) if rng.random() < 0.1 else rng.choice(NOUNS), rng.random()
    if r < 0.2:
        return noun
    brand = _made_up(rng, True) if rng.random() < 0.5 else rng.choice(BRANDS)
    if r < 0.45:
        return f"{brand} {noun}"
    code = rng.choice([f"{rng.choice('XSZVGKMR')}{rng.randint(1, 20)}", f"{rng.randint(1, 9)}000",
                       f"{rng.randint(1, 9)}00", str(rng.randint(2, 12)), rng.choice(MODELS)])
    return f"{brand} {code} {noun}"


def values(schema: str, rng: random.Random) -> dict:
    """A random record of `schema`, fields in demo_data.SCHEMAS's order."""
    ints = {f: rng.randint(*RANGES[f]) for f in FIELDS[schema] if f in RANGES}
    if schema == "product" and rng.random() < 0.7:  # most prices are everyday ones
        ints["price"] = rng.randint(5, 2000)
    make = {"name": _name, "city": _city, "company": _company, "role": _role, "product": _product,
            "color": lambda r: _made_up(r, False) if r.random() < MADE_UP / 2 else r.choice(COLORS)}
    return {f: ints[f] if f in ints else make[f](rng) for f in FIELDS[schema]}


# --- sentences ------------------------------------------------------------------------------
# "[a|b]": one option; "<X>": MACROS[X]; "{field}": a value; "a~", "this~": an article fixed once
# the next word is in ("an", "these", "a pair of"); {is}, {s}, {es}: agreement with plural products.
MACROS = {
    "<N>": "[|||||my friend |my neighbor |our client |my cousin |the new hire |our colleague ]{name}",
    "<AGE>": "[is {age}|is {age}|is {age} years old|is {age} years of age|is aged {age}|just turned {age}|"
             "turned {age} this year|is now {age}|is {age} now]",
    "<CITY>": "[lives in|lives in|resides in|is based in|is living in|has lived in|is from|comes from|"
              "moved to|settled in|makes {her} home in] {city}",
    "<MONEY>": "[${price}|${price}|{price} dollars|{price} bucks|{price} USD|USD {price}|€{price}|"
               "{price} euros|£{price}|{price}]",
    "<PRICE>": "[cost{s}|sell{s} for|{is} priced at|go{es} for|retail{s} for|{is} listed at|"
               "{is} on sale for|{is} available for|{is}] <MONEY>",
    "<COLOR>": "[{is} {color}|{is} {color}|come{s} in {color}|{is} available in {color}|{is} colored {color}]",
    "<DET>": "[a~|the|the|this~|our new|my|our|that~|your new|my new]",
    "<A>": "[a~|the|this~|one~]",
    "<Y>": "{years} {yw}",
    "<ROLE>": "a~ {role}",
    "<TENURE>": "[has worked there for <Y>|has been there for <Y>|has been with them for <Y>|"
                "has been there <Y>|joined <Y> ago|started there <Y> ago|has been there for <Y> now]",
    "<AT>": "[at|at|at|with|for]",
    "<SEP>": "[ -| –| /|;|,|,]",  # never just a space: "Ana Silva nurse" leaves the boundary a guess
}
TEMPLATES = {"person": """
<N> <AGE>[ and| and|, and {she}|. {She}] <CITY>
<N> <CITY>[ and| and| and {she}|, and {she}|; {she}|. {She}] <AGE>
<N>[, {age},| ({age})|, aged {age},|, age {age},|, {age} years old,|'s age is {age}, and {she}] <CITY>
<N>, who [<AGE>, <CITY>|<CITY>, <AGE>]
<N> is a~ {age}-year-old [from|in|living in|based in] {city}
[A~ {age}-year-old [named|called]|One {age}-year-old named|{age}-year-old] {name} <CITY>
In {city}[,|] <N> <AGE>
[In {city} lives|Living in {city} is|{city} is home to|Everyone in {city} knows] <N>,[ who is| aged| age|] {age}
[{city} is where <N> lives; {she}|<N> [from|of] {city}] <AGE>
<N> [({age}, {city})|({city}) <AGE>]
<N>[,|:] {age},[ from| of| in|] {city}
[At|Aged|Age] {age}, <N> <CITY>
[This is|Meet|Say hi to] <N>, [{age}, from|a~ {age}-year-old from|who is {age} and lives in] {city}
<N><SEP> {age}<SEP> {city}
[{city}-based|{city} resident] <N> <AGE>
<N>, a {city} resident, <AGE>
<N> <AGE>[,|] [living|based|now living] in {city}
[<N> has been living in {city} and <AGE>|Born {age} years ago, <N> <CITY>]
""", "product": """
<DET> {color} {product} <PRICE>
<DET> {product} [<COLOR> and <PRICE>|<PRICE> and <COLOR>]
{product}[ in {color}[,| -|:| for]|, {color},| ({color})[ -|:|,| for]] <MONEY>
{product} ({color}, <MONEY>)
{color} {product}[ -|:|,| for| at| only| on sale for| available for| in stock for] <MONEY>
<MONEY> [for|gets you] <A> {color} {product}
[For|For just|For only|Only] <MONEY>[,|] [get|grab|you get] <A> {product} in {color}
[I bought <A>|I ordered <A>|I got <A>|I'm selling my|I'm selling <A>|Selling <A>] {color} {product} for <MONEY>
[Selling|For sale|Now selling|Just listed|New arrival]: {color} {product}, <MONEY>
[Check out|Introducing|Meet] <DET> {product}: {color}, <MONEY>
<DET> {product} [come{s}|{is} available] in {color} [and|but] cost{s} <MONEY>
The {color} version of the {product} costs <MONEY>
[[Price|Cost] of the {color} {product}:|The price of <DET> {color} {product} is] <MONEY>
<DET> {product} [in {color} <PRICE>|<PRICE> in {color}|{is} now <MONEY> in {color}]
{product}<SEP> {color}<SEP> <MONEY>
<DET> {product}, [[which|that] {is} {color}, <PRICE>|priced at <MONEY>, {is} {color}]
<DET> {product} [({color}) <PRICE>|<PRICE> (color: {color})]
<MONEY>: {color} {product}
[We sell <DET>|Get <DET>|Buy <DET>|Just listed: <A>|New arrival: <A>] {product} in {color} [for|at] <MONEY>
""", "employee": """
<N> is <ROLE> <AT> {company} and <TENURE>
<N> has [been <ROLE> <AT> {company}|worked [at|for] {company} as <ROLE>] for <Y>
<N> works [as <ROLE> <AT> {company}|at {company} as <ROLE>][,| and] <TENURE>
<N>, <ROLE> at {company}[, <TENURE>| for <Y>]
<N> [({role}, {company}, <Y>)|({role} at {company})[ -| –|,] <Y>]
At {company}, <N> [is <ROLE> and <TENURE>|works as <ROLE> and <TENURE>|has been <ROLE> for <Y>]
For [the past |]<Y>, <N> has been <ROLE> at {company}
<Y> at {company}: <N>, {role}
[After <Y> at {company}, <N> is still <ROLE> there|<Y> in, <N> is still <ROLE> at {company}]
<N> joined {company} [<Y> ago as <ROLE>|as <ROLE> <Y> ago]
[{company} hired <N>|<N> was hired by {company}] as <ROLE> <Y> ago
{company} has employed <N> as <ROLE> for <Y>
<N> has spent <Y> at {company} as <ROLE>
<N> is <ROLE> [with <Y> at {company}|who has worked at {company} for <Y>]
[Our|The|Their] {role}, {name}, has [been with|been at|worked at] {company} for <Y>
[{company}'s {role} {name}|<N> is {company}'s {role} and] <TENURE>
<N>: {role} at {company}, <Y>
<N><SEP> {role}<SEP> {company}<SEP> <Y>
<N> [works for {company}; {she} is <ROLE> with <Y> there|has <Y> at {company}, where {she} works as <ROLE>]
<N> has been working as <ROLE> at {company} for <Y>[ now|]
<N>, who [works at {company} as <ROLE>, <TENURE>|has been at {company} for <Y>, is <ROLE>]
<N> [is <ROLE>. {She} has been at {company} for <Y>|works at {company}. {She} is <ROLE> and <TENURE>]
"""}
TEMPLATES = {schema: text.strip().splitlines() for schema, text in TEMPLATES.items()}
KEYS = {"name": "name|name|full name|Name", "age": "age|age|Age", "city": "city|city|location|hometown",
        "product": "product|item|Product", "color": "color|colour|color|Color", "price": "price|price|cost|Price",
        "role": "role|position|title|job", "years": "years|years|tenure", "company": "company|employer|Company"}
KEY_VALUES = {"price": "<MONEY>", "years": "[{years}|{years}|<Y>]"}
# Extra words that name no value and hold no digit: they never change the answer.
CONTEXT = {schema: line.split("|") for schema, line in zip(FIELDS, [
    "and loves hiking|with {her} two cats|and works from home|and plays the guitar|and speaks three languages|"
    "and is learning to code|and volunteers on weekends|and loves cooking|and has a big garden",
    "with free shipping|and it ships worldwide|in great condition|barely used|brand new in the box|"
    "with a one-year warranty|and it makes a great gift|while stocks last|plus shipping|tax included",
    "and loves the team|and mentors new hires|and enjoys the work|and works remotely|and is up for a promotion|"
    "and leads the night shift|and rarely takes a day off"])}
PREFIXES = ["so basically", "fun fact:", "by the way,", "just so you know,", "FYI:", "FYI,", "update:",
            "note:", "quick note:", "hey,", "ok so", "okay,", "for the record,", "heads up:", "btw", "so",
            "well,", "news:", "reminder:", "hi!", "hello,", "to be clear,", "honestly,"]
SUFFIXES = [", thanks", " lol", ", btw", " :)", ", I think", ", as far as I know"]
PRONOUNS = [{"she": "she", "She": "She", "her": "her"}, {"she": "he", "She": "He", "her": "his"}]


def _expand(rng, text):
    while "<" in text:
        text = re.sub(r"<[A-Z]+>", lambda m: MACROS[m.group()], text)
    while "[" in text:  # innermost brackets first
        text = re.sub(r"\[([^\[\]]*)\]", lambda m: rng.choice(m.group(1).split("|")), text)
    return text


def _key_value(rng, schema):
    """'name: X; age: Y; city: Z', in any order."""
    fields = list(FIELDS[schema])
    if rng.random() < 0.5:
        rng.shuffle(fields)
    sep, colon = rng.choice(["; ", ", ", " | ", " / ", ". "]), rng.choice([": ", ": ", ": ", " = ", " - "])
    pairs = [rng.choice(KEYS[f].split("|")) + colon + KEY_VALUES.get(f, "{%s}" % f) for f in fields]
    return _expand(rng, rng.choice(["", "", "", "record: ", "new entry: ", "details: "]) + sep.join(pairs))


def _article(m, plural):
    word, next_word = m.group(1), m.group(2)
    if word.lower() != "a":
        new = {"this": "these", "that": "those", "one": "a pair of"}[word.lower()] if plural else word
    elif plural:
        new = "a pair of"
    elif next_word[:2].isupper():  # acronyms: "an HR manager", "a UX designer"
        new = "an" if next_word[0] in "AEFHILMNORSX" else "a"
    else:  # vowel sounds, and "an 18-year-old", "an 80-year-old"
        vowel = next_word[0].lower() in "aeiou8" or next_word.startswith(("11-", "18-"))
        new = "an" if vowel and not next_word.lower().startswith(("uni", "use", "one")) else "a"
    return (new[0].upper() + new[1:] if word[0].isupper() else new) + " " + next_word


def _sentence(rng, schema, record):
    # a made-up color right before the product would leave the boundary between them a guess
    ambiguous = schema == "product" and record["color"] not in COLORS
    if rng.random() < KEY_VALUE:
        skeleton = _key_value(rng, schema)
    else:
        skeleton = _expand(rng, rng.choice([t for t in TEMPLATES[schema] if not (ambiguous and "{color} {product}" in t)]))
        if rng.random() < 0.2 and not skeleton.endswith(")"):  # "(41, Lima) and loves hiking": no
            skeleton += rng.choice([" ", ", "]) + rng.choice(CONTEXT[schema])
    text_first = skeleton[0].isalpha() and not skeleton.split()[0].isupper()  # may change case: not "I", "USD"
    if rng.random() < 0.25:  # a filler prefix; the sentence then goes on in lowercase, mostly
        prefix = rng.choice(PREFIXES)
        prefix = prefix[0].upper() + prefix[1:] if rng.random() < 0.6 else prefix
        if text_first and (prefix[-1] != ":" or rng.random() < 0.5):
            skeleton = skeleton[0].lower() + skeleton[1:]
        skeleton = f"{prefix} {skeleton}"
    elif text_first:
        skeleton = (skeleton[0].upper() if rng.random() < 0.9 else skeleton[0].lower()) + skeleton[1:]
    if rng.random() < 0.08:
        skeleton += rng.choice(SUFFIXES)
    skeleton += rng.choice(["", "", "", ".", ".", ".", ".", "!", "..."])
    plural = record.get("product", "").endswith(PLURAL)
    grammar = {"is": "are" if plural else "is", "s": "" if plural else "s", "es": "" if plural else "es",
               "yw": "year" if record.get("years") == 1 else "years", **rng.choice(PRONOUNS)}
    text = skeleton.format(**record, **grammar)
    return re.sub(r"\b(a|A|this|This|that|That|one|One)~ (\S+)", lambda m: _article(m, plural), text)


def free_dataset(num: int, seed: int) -> list[dict]:
    """`num` examples with distinct requests, shaped as demo_data.dataset's:
    {"schema", "request", "record", "answer": json.dumps(record)}."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < num:
        schema = rng.choice(sorted(FIELDS))
        record = values(schema, rng)
        request = _sentence(rng, schema, record)
        if rng.random() < LOWERCASE:
            request = request.lower()
            record = {k: v.lower() if isinstance(v, str) else v for k, v in record.items()}
        example = {"schema": schema, "request": request, "record": record, "answer": json.dumps(record)}
        if request in seen or validate(example):  # rare clashes: "Lima" twice, a model code = the price
            continue
        seen.add(request)
        out.append(example)
    return out


# --- checks ---------------------------------------------------------------------------------
def _spans(value, text):
    """Where `value` occurs as whole words (no letter or digit right before or after)."""
    spans, i = [], text.find(value)
    while i >= 0:
        j = i + len(value)
        if not (i and (text[i - 1].isalnum() or text[i - 1] == "_")) and \
                not (j < len(text) and (text[j].isalnum() or text[j] == "_")):
            spans.append((i, j))
        i = text.find(value, i + 1)
    return spans


def validate(example: dict) -> list[str]:
    """The conventions' problems with one example (empty: it keeps them all)."""
    schema, request, record = example.get("schema"), example.get("request", ""), example.get("record", {})
    if schema not in FIELDS or list(record) != list(FIELDS[schema]):
        return [f"schema {schema!r} with fields {list(record)}"]
    problems = [] if example.get("answer") == json.dumps(record) else ["answer is not json.dumps(record)"]
    if request != " ".join(request.split()) or not 4 <= len(request.split()) <= 35:
        problems.append(f"stray whitespace or {len(request.split())} words")
    for field, value in record.items():
        if field in RANGES:
            if type(value) is not int or not RANGES[field][0] <= value <= RANGES[field][1]:
                problems.append(f"{field}={value!r} is not an int in range")
            continue
        words = value.lower().split() if isinstance(value, str) else []
        if not 1 <= len(words) <= {"product": 5, "color": 2, "city": 4}.get(field, 3) or value != " ".join(value.split()):
            problems.append(f"{field}={value!r} is not a string of a few words")
            continue
        if (n := len(_spans(value, request))) != 1:
            problems.append(f"{field} {value!r} appears {n} times")
        if field != "product" and re.search(r"\d", value):
            problems.append(f"{field} {value!r} has a digit")
        if field in ("role", "product") and words[0] in ("a", "an", "the", "our", "my", "this", "these", "new"):
            problems.append(f"{field} {value!r} starts with an article")
        if field == "product" and COLOR_WORDS & set(words):
            problems.append(f"product {value!r} has a color word")
    number, rest = str(record[next(f for f in record if f in RANGES)]), request
    if schema == "product" and (spans := _spans(record["product"], request)):
        rest = request[:spans[0][0]] + " " + request[spans[0][1]:]
    if re.findall(r"\d+", rest) != [number] or re.findall(r"\d+", request).count(number) != 1:
        problems.append(f"numbers {re.findall(r'[0-9]+', request)}: want {number} once, others in the product")
    return problems


def shape(example: dict) -> str:
    """The request with each value replaced by <field>: its sentence structure."""
    text = example["request"]
    for field, value in sorted(example["record"].items(), key=lambda kv: -len(str(kv[1]))):
        if isinstance(value, int):
            text = re.sub(r"(?<!\d)" + str(value) + r"(?!\d)", f"<{field}>", text)
        else:
            text = re.sub(r"(?<!\w)" + re.escape(value) + r"(?!\w)", f"<{field}>", text)
    return text

