"""Freely phrased training requests for the embedded demo (demo_data.py's three schemas), e.g.
"Wanjiru Kamau has been a pharmacist at Kigali General Hospital for 9 years, believe it or not" ->
{"name": "Wanjiru Kamau", "role": "pharmacist", "company": "Kigali General Hospital", "years": 9}.

A bracket grammar over ~40 template lines per schema (statements, questions, requests, first person,
listings, CRM and HR notes, appositions, the number first or last), key: value lines and bare lists in
any order, fillers, clauses before and after that name no value, request frames, contractions, case and
punctuation. Values: demo_phrasing_values.py and .json. `validate` checks the conventions; digits other than the
integer may only sit inside the product ("Zenith X5 kettle"). Nothing here reads the frozen evaluation
set. Stats and samples: ./dev python scripts/demo_phrasing_stats.py
"""

import json
import random
import re

from demo_phrasing_values import (
    COLOR_RE, COLORS, CONTEXT, FIELDS, FRAMES, KEYS, MONEY, OPENERS, PLURAL, PREDICATES, PREFIXES, PRONOUNS,
    RANGES, SUFFIXES, values)

LOWERCASE = 0.08  # share of all-lowercase requests (the record's strings lowercased too)
KEY_VALUE, LIST = 0.1, 0.07  # shares of "name: X; age: Y" requests and of bare "X, 41, Lima" lists
MAX_WORDS = {"product": 5, "color": 3, "city": 4, "name": 5, "company": 5, "role": 4}  # a phrase, not a clause

# --- sentences ------------------------------------------------------------------------------
# "[a|b]": one option; "<X>": MACROS[X]; "{field}": a value ("{name's}": its possessive); "a~",
# "this~": an article fixed once the next word is in ("an", "these", "a pair of"); {is}, {s}, {es},
# {has}, {it}: agreement with plural products; {she}, {her}, {sib}...: PRONOUNS. "+": a statement
# that may follow "I heard that".
MACROS = {
    "<N>": "[|||||||||||||my friend |my neighbor |our client |my cousin |the new hire |our colleague |my {sib} |"
           "my {kin} |my coworker |our new tenant |my roommate |our customer |my classmate |{one} named |"
           "{one} called |my buddy |our member |the applicant |my old friend ]{name}",
    "<AGE>": "[is {age}|is {age}|is {age}|is {age} years old|is {age} years old|is {age} years of age|is aged {age}|"
             "just turned {age}|turned {age} [this year|last month|in May|recently|a few weeks ago]|is now {age}|"
             "is {age} now|turns {age} [next month|this year|soon|in June]|is {age} yrs old|is {age}yo|"
             "is {age} y/o|'s {age}|is only {age}|is already {age}|is about to turn {age}|has just turned {age}|"
             "celebrated {her} {age}{ord} birthday [last week|yesterday|in March]|is {age} this year]",
    "<CITY>": "[lives in {city}|lives in {city}|lives in {city}|resides in {city}|is based in {city}|"
              "is living in {city}|has lived in {city}|has been living in {city}|is from {city}|comes from {city}|"
              "is originally from {city}|hails from {city}|moved to {city}|recently moved to {city}|"
              "just moved to {city}|relocated to {city}|settled in {city}|makes {her} home in {city}|"
              "currently lives in {city}|lives and works in {city}|grew up in and still lives in {city}|"
              "is now based in {city}|calls {city} home|has made {city} {her} home|has {her} home in {city}|"
              "is a~ {city} native|is a~ {city} local|is a resident of {city}|is living in {city} these days|"
              "stays in {city}|rents a flat in {city}|has a place in {city}|lives over in {city}]",
    "<AGEP>": "[, {age},|, {age},| ({age})|, aged {age},|, age {age},|, {age} years old,|, {age}yo,| ({age} y/o)|"
              ", {age} years of age,|, who is {age},|, who just turned {age},|, a~ {age}-year-old,|, {age} yrs,]",
    "<MONEY>": MONEY,
    "<PRICE>": "[cost{s}|cost{s}|sell{s} for|{is} priced at|go{es} for|retail{s} for|{is} listed at|{is} on sale for|"
               "{is} available for|{is}|{is}|{is} going for|{is} selling for|{is} marked down to|{is} reduced to|"
               "now cost{s}|will set you back|run{s}|{is} offered at|can be had for|{is} yours for|{is} now only|"
               "{is} just|{is} a steal at|{is} tagged at|only cost{s}|{is} worth] <MONEY>",
    "<COLOR>": "[{is} {color}|{is} {color}|come{s} in {color}|{is} available in {color}|{is} colored {color}|"
               "{is} in {color}|{is} finished in {color}|{is} the {color} one|{is} the {color} version|"
               "{has} a {color} finish|{is} done in {color}|{is} {color} in color]",
    "<DET>": "[a~|a~|the|the|the|this~|our new|my|our|that~|your new|my new|a brand new|one~|the new|this new|"
             "{her}|my old|a used]",
    "<A>": "[a~|the|this~|one~]",
    "<Y>": "[<YY>|<YY>|<YY>|<YY>|<YY>|<YY>|<YY>|<YY>|<YY>|<YY>|<YY>|<YY>|<YY>|<YY>|about <YY>|a good <YY>|"
           "nearly <YY>|over <YY>|almost <YY>|{years} long {yw}|{years}-plus {yw}]",
    "<YY>": "{years} {yw}",
    "<ROLE>": "[a~|a~|a~|a~|a~|our|the] {role}",
    "<AT>": "[at|at|at|at|with|for|@]",
    "<TENURE>": "[has worked there for <Y>|has been there for <Y>|has been with them for <Y>|has been there <Y>|"
                "joined <Y> ago|started there <Y> ago|has been there for <Y> now|has been on the team for <Y>|"
                "has <Y> there|has <Y> under {her} belt there|has put in <Y> there|has clocked <Y> there|"
                "has been with the company for <Y>|is <Y> in|has been employed there for <Y>|"
                "has been there for the past <Y>|has been doing it for <Y>|has stayed for <Y>|has held the job for <Y>|"
                "has been in the role for <Y>|has been part of the team for <Y>|has been on staff for <Y>]",
    "<TENC>": "[has worked at {company} for <Y>|has been with {company} for <Y>|has been at {company} <Y>|"
              "joined {company} <Y> ago|started at {company} <Y> ago|has been with {company} since <Y>|"
              "has <Y> at {company}|is a~ {years}-year veteran of {company}|has spent the past <Y> at {company}|"
              "has been employed by {company} for <Y>|was hired by {company} <Y> ago|came to {company} <Y> ago|"
              "is <Y> into {her} time at {company}|has been on {company's} payroll for <Y>]",
    "<EMP>": "[is <ROLE> at {company}|is <ROLE> at {company}|is <ROLE> with {company}|works as <ROLE> at {company}|"
             "works at {company} as <ROLE>|is employed by {company} as <ROLE>|is employed as <ROLE> at {company}|"
             "is <ROLE> on the <TEAM> at {company}|works for {company} as <ROLE>|is {company's} {role}|"
             "serves as <ROLE> at {company}|is <ROLE> over at {company}|works as <ROLE> for {company}|"
             "holds the [position|title|role] of {role} at {company}|is currently <ROLE> at {company}|"
             "is working as <ROLE> at {company}|is now <ROLE> at {company}|works <AT> {company} as <ROLE>]",
    "<TEAM>": "[night shift|day shift|sales team|design team|support team|core team|team|night crew]",
    "<H>": "[||||||| actually| apparently| probably|, I think,|, I believe,]",  # a hedge or filler word
    "<SEP>": "[ -| –| /|;|,|,|,| {bar}]",  # never just a space: "Ana Silva nurse" leaves the boundary a guess
}
TEMPLATES = {"person": """
+<N><H> <AGE>[ and| and|, and {she}|. {She}|; {she}| and also|, and| and {she}] <CITY>
+<N><H> <CITY>[ and| and| and {she}|, and {she}|; {she}|. {She}| - {she}| and {she}<H>] <AGE>
+<N><AGEP> <CITY>
+<N>, who [<AGE>, <CITY>|<CITY>, <AGE>]
+<N> is a~ {age}-year-old [from|in|living in|based in|who lives in|currently in|residing in] {city}
+[A~ {age}-year-old [named|called]|One {age}-year-old named|{age}-year-old|The {age}-year-old] {name} <CITY>
+[In|Over in|Back in|Here in] {city}[,|] <N> <AGE>
+[In {city} lives|Living in {city} is|{city} is home to|Everyone in {city} knows] <N>,[ who is| aged| age|] {age}
+[{city} is where <N> lives; {she}|<N> [from|of] {city}] <AGE>
<N> [({age}, {city})|({city}) <AGE>|({age}) <CITY>|{lb}{age}, {city}{rb}|- {age}, {city}]
<N>[,|:| -| –] {age},[ from| of| in| lives in| based in|] {city}
+[At|Aged|Age] {age}, <N> <CITY>
[This is|Meet|Say hi to|Please welcome|Introducing] <N>, \
[{age}, from|a~ {age}-year-old from|who is {age} and lives in|{age} years old, living in|aged {age}, based in] {city}
+[{city}-based|{city} resident|{city} native|{city} local] <N> <AGE>
+<N>, a~ [{city} resident|{city} native|{city} local], <AGE>
+<N> <AGE>[,|] [living|based|now living|residing|currently living] in {city}
+<N> has been living in {city} [for a while|for ages|since {she} was a kid|all {her} life] and <AGE>
+Born {age} years ago, <N> <CITY>
[I'm|I am|My name is|Name's|Hi, I'm|Hello, my name is|Hey! I'm] {name}[,| and] [I'm {age}|I am {age} years old|{age} years old|\
{age}] [and I live in|and I'm from|from|living in|and I'm based in|, based in|, living in] {city}
[I'm|I am] {age} [and I live in|and I'm from|and live in|, living in] {city}[, my name is|. Name's|. I'm| - my name is] {name}
{name} here[,|:| -] {age}[,| from| and living in| in] {city}
+My {sib}'s name is {name}; {she} <AGE> and <CITY>
[Did you know|Is it true|Have you heard] that <N> <AGE> and <CITY>?
How old is <N>? {She} <AGE> and <CITY>
Where does <N> live? [In {city}|{city}][, and {she} <AGE>|; {she}'s {age}]
+<N>, {age}, [from|of|in] {city}, <PRED>
[Please add|Add|Log|Register|Save|Create a profile for] <N>, {age}, [from|of|in|living in] {city}
[Can you add|Could you register|Can you save] <N> ({age}) from {city}?
[New member|New contact|Guest|Passenger|Applicant|Resident|Volunteer|Customer|Tenant]: {name}, {age}, {city}
{age}[,| -] {name}[,| -| from] {city}
+{age}-year-old {name} [from|of|in] {city} <PRED>
{age} y/o {name} [from|in|living in] {city}[ <PRED>|]
+<N> <CITY>. [{She} <AGE>|Age: {age}|Age {age}|{age} years old]
+[<N>'s home is in {city}|Home for <N> is {city}|<N>'s hometown is {city}|<N>'s city is {city}][, and|;] {she} <AGE>
+<N>'s age is {age}[ and {her} city is {city}|, and {she} <CITY>|; city: {city}]
+[Turning {age} [this year|next month]|Having just turned {age}|Now {age}], <N> <CITY>
+After years abroad, <N> moved back to {city}; {she} <AGE>
+<N> <AGE>[. {Her}|; {her}] [home is in|family lives in|new place is in|address is in] {city}
+[{age} years old and living in {city},|Just {age} and already in {city},|{age} and new to {city},] <N> <PRED>
+<N> lives[|, I think,| apparently|, apparently,] in {city} and is[| probably| around| about|, I believe,] {age}
+<N> <PRED> - {she}<H> <AGE> and <CITY>
""", "product": """
+<DET> {color} {product} <PRICE>
+<DET> {product} [<COLOR> and <PRICE>|<PRICE> and <COLOR>|<COLOR>, <PRICE>|<COLOR>; {it} <PRICE>]
{product}[ in {color}[,| -|:| for| at| –]|, {color},| ({color})[ -|:|,| for| –]] <MONEY>
{product} ({color}, <MONEY>)
{color} {product}[ -|:|,| for| at| only| on sale for| available for| in stock for| –| now| just| @] <MONEY>
<MONEY> [for|gets you|buys you|will get you] <A> {color} {product}
[For|For just|For only|Only|Just] <MONEY>[,|] [get|grab|you get|you can get|take home] <A> {product} in {color}
[I bought|I ordered|I got|I'm selling|Selling|We just got|My {kin} sold me|I picked up] [<A>|my] {color} {product} for <MONEY>
I paid <MONEY> for [<A>|my] {color} {product}
[Selling|For sale|Now selling|Just listed|New arrival|FOR SALE|WTS|Available|In stock]: {color} {product}, \
<MONEY>[ obo| firm| or best offer| negotiable|]
[Check out|Introducing|Meet|Say hello to] <DET> {product}: {color}, <MONEY>
+<DET> {product} [come{s}|{is} available] in {color} [and|but] cost{s} <MONEY>
+The {color} [version|edition|model|variant] of the {product} [costs|is|sells for|goes for] <MONEY>
[[Price|Cost] of the {color} {product}:|The price of <DET> {color} {product} is|The {color} {product}'s price is] <MONEY>
+<DET> {product} [in {color} <PRICE>|<PRICE> in {color}|{is} now <MONEY> in {color}]
+<DET> {product}, [[which|that] {is} {color}, <PRICE>|priced at <MONEY>, {is} {color}]
+<DET> {product} [({color}) <PRICE>|<PRICE> (color: {color})|<PRICE> (colour: {color})]
<MONEY>[:| -| –| for the| for a~] {color} {product}
[We sell <DET>|Get <DET>|Buy <DET>|Just listed: <A>|New arrival: <A>|Order <DET>] {product} in {color} [for|at] <MONEY>
[How much is|What's the price of] the {product} in {color}? [It says|Looks like|The tag says|I think it's|Apparently] <MONEY>
Is the {color} {product} really <MONEY>?
[Anyone want|Who wants|Interested in] <A> {color} {product}? [Only |Just |Asking |It's |]<MONEY>
Asking <MONEY> for my {color} {product}
{product}<SEP> {color}<SEP> [asking |price |now |only |]<MONEY>
[I spotted|I saw|We found] <A> {product} in {color} [at the mall|online|at the market|in town|at a garage sale] for <MONEY>
[Great deal|Good price|Not bad|Steal|Bargain]: <A> {color} {product} for <MONEY>
+<DET> {product} in [{color}|a~ {color} finish|the {color} colorway] [run{s}|cost{s}|{is}|will set you back] <MONEY>
+<DET> {color} {product}, <MONEY>, <PRED>
+The {product} I want [come{s}|{is}] in {color} and [cost{s}|{is}] <MONEY>
+[My {kin}|My {sib}|My boss] [just bought|got me|ordered] <A> {color} {product} [for|at] <MONEY>
<MONEY>? For <A> {color} {product}? [Sounds fair|Not bad|Deal|Wow]
+You can get <A> {product} in {color} for <MONEY>[ these days| right now| at most shops|]
+<DET> {product} <PRICE>[,| -| and] {it} {is} {color}
+Only <MONEY>! <DET> {product} in {color}
+<DET> {product} [<COLOR>|{is} {color}]<H>, and {it}<H> <PRICE>
+{product} in {color}, now <MONEY>[ at the outlet| online| in store|]
[Item|Listing|Product|Offer]: {color} {product} [at|for|-] <MONEY>
""", "employee": """
+<N><H> <EMP> and <TENURE>
+<N> has [been <ROLE> <AT> {company}|worked [at|for] {company} as <ROLE>|been working as <ROLE> at {company}|\
served as <ROLE> at {company}] for [|||the past |the last ]<Y>[ now|]
+<N> works [as <ROLE> <AT> {company}|at {company} as <ROLE>][,| and] <TENURE>
<N>, <ROLE> at {company}[, <TENURE>| for <Y>| (<Y>)| since <Y>]
<N> [({role}, {company}, <Y>)|({role} at {company})[ -| –|,] <Y>|({role}) <TENC>]
+At {company}, <N> [is <ROLE> and <TENURE>|works as <ROLE> and <TENURE>|has been <ROLE> for <Y>]
+For [the past |the last |over |]<Y>, <N> has been <ROLE> at {company}
<Y> at {company}[:|,| -] <N>, {role}
+[After <Y> at {company}, <N> is still <ROLE> there|<Y> [in|later], <N> is still <ROLE> at {company}]
+<N> joined {company} [<Y> ago as <ROLE>|as <ROLE> <Y> ago]
+[{company} hired <N>|<N> was hired by {company}|<N> got hired at {company}] as <ROLE> <Y> ago
+{company} has employed <N> as <ROLE> for <Y>
+<N> has spent <Y> at {company} as <ROLE>
+<N> is <ROLE> [with <Y> at {company}|who has worked at {company} for <Y>|with <Y> of experience at {company}]
+[Our|The|Their] {role}, {name}, has [been with|been at|worked at] {company} for <Y>
+[{company's} {role}, {name},|<N> is {company's} {role} and] <TENURE>
<N>: {role} at {company}, <Y>
<N><SEP> {role}<SEP> {company}<SEP> <Y>
+<N> [works for {company}; {she} is <ROLE> with <Y> there|has <Y> at {company}, where {she} works as <ROLE>]
+<N>, who [works at {company} as <ROLE>, <TENURE>|has been at {company} for <Y>, is <ROLE>]
+<N> [is <ROLE>. {She} has been at {company} for <Y>|works at {company}. {She} is <ROLE> and <TENURE>]
[I'm|I am|My name is|Hi, I'm] {name}[,|.|;] [I've been|I have been|I'm] <ROLE> at {company} [for <Y>|since <Y>]
[I work|I've worked|I have worked] as <ROLE> at {company}[ for <Y>|, <Y> now|, going on <Y>]\
[; my name is|. Name's|. I'm| -] {name}
{name} here[,| -] {role} at {company}[,| for| since] <Y>
Congrats to <N> on <Y> [as <ROLE> at {company}|at {company} as <ROLE>]!
[Please welcome|Say hi to|Meet] <N>, <ROLE> with <Y> at {company}
[Please add|Add|Log|Register] <N> [as|to the directory:|-] <ROLE> at {company}, <Y>
[Employee|Staff member|Team member|New hire|Contractor|Staff]: {name}, {role}, {company}, <Y>
+<N>, a~ {years}-year veteran of {company}, [is|works as] <ROLE> there
+<N>[ works| is working| has been working] at {company} as <ROLE> since <Y>
+<N> [has clocked|has put in|has logged] <Y> at {company} as <ROLE>
+[In|Over] {her} <Y> at {company}, <N> has [been|worked as] <ROLE>
<Y> ago, <N> [joined|started at] {company} as <ROLE>
+<N> [started|began] [{her} career|working] at {company} <Y> ago as <ROLE>[ and never left| and is still there|]
+<N> is <ROLE> on the <TEAM> at {company}[,| and] <TENURE>
{role} <AT> {company} for <Y>: <N>
<N> – {role}, {company} ([since <Y>|<Y>|<Y> so far|<Y> and counting])
+<N> worked as <ROLE> at {company} for <Y>[ before retiring| before moving on|]
How long has <N> been at {company}? <Y>[, as <ROLE>| - {she} is <ROLE> there]
<N> is <ROLE>. [Employer|Company]: {company}. [Tenure|Years]: <Y>
+{name}, {role}, [has been|is] with {company} [for <Y>|<Y> now]
+<N> <EMP>[,| -| –] <Y>[ now| so far| and counting|]
+<N>, <ROLE> at {company} for <Y>, <PRED>
+<N> <EMP>; <Y> [there|so far|now|and counting]
"""}
TEMPLATES = {schema: text.strip().splitlines() for schema, text in TEMPLATES.items()}
UNITS = {"age": "[{age}|{age}|{age}|{age} years|{age}y|{age} yrs|{age} y/o]", "price": "<MONEY>",
         "years": "[{years}|{years}|<Y>|<Y>|{years}y|{years}+ years]"}


def _expand(rng, text):
    while "<" in text:
        text = re.sub(r"<[A-Z]+>", lambda m: MACROS[m.group()], text)
    while "[" in text:  # innermost brackets first
        text = re.sub(r"\[([^\[\]]*)\]", lambda m: rng.choice(m.group(1).split("|")), text)
    return text


def _fields(rng, schema, keyed):
    """'name: X; age: 41; city: Y' (keyed) or 'X, 41, Y': in any order, mostly the schema's."""
    fields = list(FIELDS[schema])
    if rng.random() < (0.5 if keyed else 0.3):
        rng.shuffle(fields)
    colon = rng.choice([": ", ": ", ": ", ": ", " = ", " - ", " – ", ":", "=", " -> "])
    items = [(rng.choice(KEYS[f].split("|")) + colon if keyed else "") + UNITS.get(f, "{%s}" % f) for f in fields]
    sep = rng.choice(["; ", ", ", " | ", " / ", ". ", " - ", " · ", " • "] if keyed else
                     [", ", ", ", ", ", ",", " | ", " / ", " - ", " – ", "; "])
    lead = rng.choice(["", "", "", "", "", "record: ", "new entry: ", "details: ", "profile - ", "row: ",
                       "form data: "] if keyed else ["", "", "", "", "New: ", "Add: ", "Log: ", "Entry - "])
    return _expand(rng, lead + sep.join(items))


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
        new = "an" if vowel and not next_word.lower().startswith(("uni", "use", "one", "eu")) else "a"
    return (new[0].upper() + new[1:] if word[0].isupper() else new) + " " + next_word


def _lower_first(text):
    first = text.split()[0]  # keep "I", "I'm", "USD", "FYI"
    return text if not text[0].isalpha() or first.startswith("I'") or first.isupper() else text[0].lower() + text[1:]


def _upper_first(text):
    return text[0].upper() + text[1:] if text[:1].isalpha() else text


CONTRACTIONS = [(r"\b([Ss]he|[Hh]e|[Ii]t|[Tt]hat|[Ww]ho) is\b", r"\1's"), (r"\bI am\b", "I'm"),
                (r"\b([Ss]he|[Hh]e|[Ww]ho) has (been|worked|lived|spent)\b", r"\1's \2"),
                (r"\bI have (been|worked)\b", r"I've \1"), (r"\b([Tt]hey) are\b", r"\1're")]


def _sentence(rng, schema, record):
    # a made-up color right before the product would leave the boundary between them a guess
    ambiguous = schema == "product" and record["color"] not in COLORS
    statement, fields, r = False, True, rng.random()
    if r < KEY_VALUE + LIST:
        skeleton = _fields(rng, schema, keyed=r < KEY_VALUE)
    else:
        fields = False
        line = rng.choice([t for t in TEMPLATES[schema] if not (ambiguous and "{color} {product}" in t)])
        statement, line = line.startswith("+"), line.lstrip("+")
        skeleton = _expand(rng, line.replace("<PRED>", "[" + "|".join(PREDICATES[schema]) + "]"))
        if statement and rng.random() < 0.2 and skeleton[-1] not in ")?!":
            skeleton += rng.choice([" ", ", "]) + rng.choice(CONTEXT[schema])
    closed, r = skeleton[-1] in "?!", rng.random()
    if r < 0.1 and not closed:  # a request around the facts: "please log this: ...", "can you record that ...?"
        # "I heard that @" takes a statement, "pls add @" a statement or a list, "log this: @" anything
        frames = [f for f in FRAMES if statement or re.search(r"(^|: |\? )@" if not fields else r"^((?!that @|me @).)*$", f)]
        before, after = rng.choice(frames).split("@")
        if before and not before.endswith((": ", "? ")):
            skeleton = _lower_first(skeleton)
        skeleton = (_upper_first(before) if rng.random() < 0.7 else before) + skeleton + after
        closed = closed or after[-1:] in ".?!)"
    elif r < 0.35:  # a filler or a clause before; the sentence then goes on in lowercase, mostly
        prefix = rng.choice(OPENERS[schema] if statement and rng.random() < 0.5 else PREFIXES)
        prefix = _upper_first(prefix) if rng.random() < 0.6 else prefix
        if prefix[-1] not in ":-" or rng.random() < 0.5:
            skeleton = _lower_first(skeleton)
        skeleton = f"{prefix} {skeleton}"
    else:
        skeleton = _upper_first(skeleton) if rng.random() < 0.9 else _lower_first(skeleton)
    if not closed:
        if rng.random() < 0.08:
            skeleton += rng.choice(SUFFIXES)
        skeleton += rng.choice(["", "", "", ".", ".", ".", ".", "!", "..."])
    plural, age = record.get("product", "").endswith(PLURAL), record.get("age", 0)
    grammar = {"is": "are" if plural else "is", "s": "" if plural else "s", "es": "" if plural else "es",
               "has": "have" if plural else "has", "it": "they" if plural else "it", "lb": "[", "rb": "]", "bar": "|",
               "yw": rng.choice(["years"] * 7 + ["yrs"]) if record.get("years") != 1 else "year",
               "ord": "th" if 10 <= age % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(age % 10, "th"),
               **rng.choice(PRONOUNS)}
    possessives = {f"{f}'s": record[f] + ("'" if record[f].endswith("s") else "'s") for f in ("name", "company")
                   if f in record}
    text = skeleton.format(**record, **grammar, **possessives)
    text = re.sub(r"\b(a|A|this|This|that|That|one|One)~ (\S+)", lambda m: _article(m, plural), text)
    if rng.random() < 0.3:
        for pattern, contracted in CONTRACTIONS:
            text = re.sub(pattern, contracted, text)
    text = re.sub(r" '(s|m|re|ve)\b", r"'\1", text.replace(" ,", ","))  # "Ana 's 41" -> "Ana's 41"
    return re.sub(r"(?<!\.)\.\.(?!\.)", ".", text)  # "Acme Inc.." -> "Acme Inc."


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
    if request != " ".join(request.split()) or len(request.split()) > 35:
        problems.append(f"stray whitespace or {len(request.split())} words")
    if request == request.lower() and any(isinstance(v, str) and v != v.lower() for v in record.values()):
        problems.append("an all-lowercase request with a value in capitals")
    for field, value in record.items():
        if field in RANGES:
            if type(value) is not int or not RANGES[field][0] <= value <= RANGES[field][1]:
                problems.append(f"{field}={value!r} is not an int in range")
            continue
        words = value.lower().split() if isinstance(value, str) else []
        if not 1 <= len(words) <= MAX_WORDS[field] or value != " ".join(value.split()):
            problems.append(f"{field}={value!r} is not a string of a few words")
            continue
        if (n := len(_spans(value, request))) != 1:
            problems.append(f"{field} {value!r} appears {n} times")
        if field != "product" and re.search(r"\d", value):
            problems.append(f"{field} {value!r} has a digit")
        if field in ("role", "product") and words[0] in ("a", "an", "the", "our", "my", "your", "his", "her",
                                                          "this", "these", "new"):
            problems.append(f"{field} {value!r} starts with an article")
        if field == "product" and (COLOR_RE.search(value.lower()) or "'s" in value):
            problems.append(f"product {value!r} has a color word or a possessive")
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
