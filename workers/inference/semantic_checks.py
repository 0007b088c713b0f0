"""Structured checks a semantic-cache candidate must pass: what an embedding blurs.

Sentence embeddings put "What is the capital of France?" beside "... of Germany?"
(cosine ~0.9 with all-MiniLM-L6-v2), "is it safe" beside "is it unsafe", "10 miles to
km" beside "10 km to miles". Whatever the similarity, two texts may share an answer only
when they carry the same:

- `numbers`: digits and number words (`15%` and `fifteen percent` agree; ordinals count:
  "first" is 1; a lone 1 is what "a" says too), so amounts, versions and years;
- `dates`: month and weekday names, today/tomorrow/yesterday, seasons (one text naming
  one the other does not while the other names one it does not);
- `units`: a canonical name per unit (km and kilometers agree; km and miles do not),
  compared when both texts name units;
- `names`: capitalised words not at the start of a sentence, and quoted words; each must
  be a word of the other text (in any case);
- `order`: the same names and units, or the same content words, in another order
  ("from London to New York" against "from New York to London");
- `negation`: the parity of negations (not, no, never, n't, without, ...);
- `polarity`: a word one text holds whose opposite the other holds (increase/decrease,
  install/remove, largest/smallest, before/after, ...), or whose negated form (un-, in-,
  im-, il-, ir-, dis-, non-) it holds (safe/unsafe).

Each check returns its name when the texts disagree. The checks are deliberately strict:
they refuse some harmless paraphrases ("US" vs "the United States"), which then simply
run; they never make a miss into a hit.
"""

from __future__ import annotations

import re
from functools import lru_cache

_TOKEN = re.compile(r"\d+(?:[.,]\d+)*|[^\W\d_]+(?:['’][^\W\d_]+)?|%|\$|€|£|°", re.UNICODE)
_QUOTED = re.compile(r"[\"“”‘’`]([^\"“”‘’`]{1,80})[\"“”‘’`]"
                     r"|(?:(?<=\s)|^)'([^']{1,80})'(?=\W|$)")
_SENTENCE_ENDS = frozenset(".!?:;\n")

NUMBER_WORDS = {
    "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12",
    "thirteen": "13", "fourteen": "14", "fifteen": "15", "sixteen": "16", "seventeen": "17",
    "eighteen": "18", "nineteen": "19", "twenty": "20", "thirty": "30", "forty": "40",
    "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90",
    "hundred": "100", "thousand": "1000", "million": "1000000", "billion": "1000000000",
    "first": "1", "second": "2", "third": "3", "fourth": "4", "fifth": "5", "tenth": "10",
    "half": "0.5", "twice": "2", "double": "2", "triple": "3", "dozen": "12",
}
DATE_WORDS = frozenset({
    "january", "february", "march", "april", "may", "june", "july", "august", "september",
    "october", "november", "december", "jan", "feb", "mar", "apr", "jun", "jul", "aug",
    "sep", "sept", "oct", "nov", "dec", "monday", "tuesday", "wednesday", "thursday",
    "friday", "saturday", "sunday", "mondays", "tuesdays", "wednesdays", "thursdays",
    "fridays", "saturdays", "sundays", "today", "tomorrow", "yesterday", "tonight",
    "weekend", "weekday", "spring", "summer", "autumn", "winter", "morning",
    "evening", "night",
})
_UNIT_GROUPS = (
    ("km", "kilometer", "kilometers", "kilometre", "kilometres"),
    ("mile", "miles", "mi"), ("mph",), ("meter", "meters", "metre", "metres", "m"),
    ("foot", "feet", "ft"), ("inch", "inches", "in."), ("cm", "centimeter", "centimeters"),
    ("kg", "kilo", "kilos", "kilogram", "kilograms", "kgs"), ("g", "gram", "grams"),
    ("lb", "lbs", "pound", "pounds"), ("oz", "ounce", "ounces"),
    ("l", "liter", "liters", "litre", "litres"), ("ml", "milliliter", "milliliters", "millilitre"),
    ("cup", "cups"), ("gallon", "gallons"), ("tablespoon", "tablespoons", "tbsp"),
    ("teaspoon", "teaspoons", "tsp"), ("celsius", "centigrade"), ("fahrenheit",),
    ("kelvin",), ("%", "percent", "per cent", "percentage"), ("$", "dollar", "dollars", "usd"),
    ("€", "euro", "euros", "eur"), ("£", "gbp", "sterling"), ("yen", "jpy"),
    ("second", "seconds", "sec", "secs"), ("minute", "minutes", "min", "mins"),
    ("hour", "hours", "hr", "hrs"), ("day", "days"), ("week", "weeks"),
    ("month", "months"), ("year", "years"), ("gb", "gigabyte", "gigabytes"),
    ("mb", "megabyte", "megabytes"), ("tb", "terabyte", "terabytes"),
)
UNITS = {alias: group[0] for group in _UNIT_GROUPS for alias in group}
# Words of opposite sense, in pairs; a text's set of these must equal the other's.
_POLAR_PAIRS = (
    ("safe", "dangerous"), ("increase", "decrease"), ("increase", "reduce"),
    ("raise", "lower"), ("add", "remove"), ("add", "delete"), ("add", "drop"),
    ("install", "remove"), ("buy", "sell"), ("rent", "own"), ("open", "close"),
    ("open", "closed"), ("opening", "closing"), ("enable", "disable"),
    ("start", "end"), ("start", "stop"), ("begin", "end"), ("begin", "finish"),
    ("before", "after"), ("maximum", "minimum"), ("max", "min"), ("largest", "smallest"),
    ("biggest", "smallest"), ("tallest", "shortest"), ("highest", "lowest"),
    ("longest", "shortest"), ("fastest", "slowest"), ("best", "worst"), ("good", "bad"),
    ("better", "worse"), ("cheaper", "expensive"), ("cheap", "expensive"), ("more", "less"),
    ("more", "fewer"), ("heavier", "lighter"), ("hot", "cold"), ("boiling", "freezing"),
    ("melting", "freezing"), ("reading", "writing"), ("read", "write"),
    ("running", "stopped"), ("benefits", "risks"), ("pros", "cons"), ("hard", "soft"),
    ("import", "export"), ("upload", "download"), ("join", "split"),
    ("merge", "split"), ("encrypt", "decrypt"), ("win", "lose"), ("won", "lost"),
    ("beat", "lost"), ("pass", "fail"), ("true", "false"), ("locally", "remotely"),
    ("local", "remote"), ("vertically", "horizontally"), ("similarity", "difference"),
    ("causes", "cures"), ("prevent", "cause"), ("symptoms", "causes"), ("built", "fell"),
    ("push", "pull"), ("north", "south"),
    ("east", "west"), ("adult", "child"), ("adults", "children"), ("male", "female"),
    ("men", "women"), ("import", "export"), ("inside", "outside"), ("early", "late"),
    ("earliest", "latest"), ("oldest", "newest"),
    ("positive", "negative"), ("gain", "lose"), ("profit", "loss"), ("accept", "reject"),
    ("allowed", "forbidden"), ("legal", "banned"), ("wet", "dry"), ("full", "empty"),
)
OPPOSITES: dict[str, frozenset[str]] = {
    word: frozenset(y for x, y in _POLAR_PAIRS if x == word)
    | frozenset(x for x, y in _POLAR_PAIRS if y == word)
    for pair in _POLAR_PAIRS for word in pair}
NEGATIONS = frozenset({
    "not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "nowhere",
    "without", "cannot", "isnt", "arent", "wasnt", "werent", "dont", "doesnt", "didnt",
    "wont", "wouldnt", "shouldnt", "couldnt", "cant", "hasnt", "havent", "hadnt", "aint",
})
_NEGATING_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non")
CHECKS = ("numbers", "dates", "units", "names", "order", "negation", "polarity")
# Words that carry no content of their own (for the word-order check and overlap).
STOP_WORDS = frozenset("""
a an the of to in on at by for from with about as into onto over under and or but if so
than then is are was were be been being am do does did done doing have has had having i me
my mine you your yours we us our they them their he him his she her it its this that these
those what which who whom whose when where why how can could should would will shall may
might must there here please hey hi hello thanks thank just quick question tell s whats
""".split())
# Capitalised but never a name.
NOT_NAMES = frozenset({"i", "im", "ive", "id", "ill", "ok", "okay"})


def disagreements(text: str, other: str) -> list[str]:
    """The names of the checks on which two texts disagree (empty: they agree)."""
    a, b = salient(text), salient(other)
    failed = []
    # "one pound" and "a pound" agree: 1 is what an article says too.
    if a.numbers - {"1"} != b.numbers - {"1"}:
        failed.append("numbers")
    # Conflicting, not merely missing: "when" and "what year" ask the same.
    if a.dates - b.dates and b.dates - a.dates:
        failed.append("dates")
    if a.units and b.units and a.units != b.units:
        failed.append("units")
    # Every name of one text is a word of the other (any case: "python" is Python).
    if not a.names <= b.words or not b.names <= a.words:
        failed.append("names")
    elif a.order != b.order and set(a.order) == set(b.order) or _swapped(a.content,
                                                                         b.content):
        failed.append("order")  # "London to New York" and "New York to London"
    if a.negation_parity != b.negation_parity:
        failed.append("negation")
    if _opposed(a.polar - b.polar, b.polar - a.polar) or _negated_forms(
            a.words - b.words, b.words - a.words):
        failed.append("polarity")
    return failed


def _swapped(mine: tuple[tuple[str, int], ...], theirs: tuple[tuple[str, int], ...]) -> bool:
    """Whether two content words changed places ("baking soda instead of baking powder"
    against "baking powder instead of baking soda", "who beat Spain" against "who did
    Spain beat"); a pair adjacent in one text only ("a Python list", "a list in Python")
    is a rewording, not a swap."""
    words, other = [w for w, _ in mine], [w for w, _ in theirs]
    if words == other or sorted(words) != sorted(other):
        return False
    differ = [i for i, (w, o) in enumerate(zip(words, other, strict=True)) if w != o]
    first, last = differ[0], differ[-1]
    return (len(differ) == 2 and words[first] == other[last] and words[last] == other[first]
            and (mine[last][1] - mine[first][1] > 1) == (theirs[last][1] - theirs[first][1] > 1))


def _opposed(only_a: frozenset[str], only_b: frozenset[str]) -> bool:
    """Whether one text holds a word whose opposite the other holds."""
    return any(OPPOSITES[word] & only_b for word in only_a)


@lru_cache(maxsize=4096)
def salient(text: str) -> Salient:
    """`Salient.of(text)`, remembered: a cached prompt is checked against many askers."""
    return Salient.of(text)


class Salient:
    """What the checks compare of one text."""

    __slots__ = ("numbers", "dates", "units", "names", "order", "negation_parity", "polar",
                 "words", "content")

    def __init__(self, numbers: frozenset[str], dates: frozenset[str], units: frozenset[str],
                 names: frozenset[str], order: tuple[str, ...], negation_parity: int,
                 polar: frozenset[str], words: frozenset[str],
                 content: tuple[tuple[str, int], ...]) -> None:
        self.numbers, self.dates, self.units, self.names = numbers, dates, units, names
        self.order = order  # names and units by first appearance
        self.negation_parity, self.polar, self.words = negation_parity, polar, words
        self.content = content  # (word, its position among all words), stop words left out

    @classmethod
    def of(cls, text: str) -> Salient:
        """The salient parts of `text` (see the module docstring)."""
        numbers: set[str] = set()
        dates: set[str] = set()
        units: set[str] = set()
        names = {(q or single).strip().casefold() for q, single in _QUOTED.findall(text)}
        polar: set[str] = set()
        words: list[str] = []
        order: dict[str, None] = {}
        content: list[tuple[str, int]] = []
        negations = 0
        previous_end = 0  # where the token before this one ended
        for match in _TOKEN.finditer(text):
            token = match.group(0)
            gap = text[previous_end:match.start()]
            starts_sentence = previous_end == 0 or any(c in _SENTENCE_ENDS for c in gap)
            previous_end = match.end()
            folded = token.casefold().replace("’", "'")
            if folded.endswith("'s"):  # California's is California
                folded = folded[:-2]
            folded = folded.replace("'", "")
            if token[0].isdigit():
                numbers.add(token.replace(",", ""))
                continue
            words.append(folded)
            # Adverbs move freely ("briefly explain" is "explain briefly").
            if folded not in STOP_WORDS and not folded.endswith("ly"):
                content.append((folded, len(words)))
            if folded in UNITS and (folded != "second" or _is_unit_context(text, match.end())):
                units.add(UNITS[folded])
                order.setdefault(UNITS[folded])
            elif folded in NUMBER_WORDS:
                numbers.add(NUMBER_WORDS[folded])
            if folded in DATE_WORDS and not (folded == "may" and token[0].islower()):
                dates.add(folded.removesuffix("s") if folded.endswith("days") else folded)
            if folded in NEGATIONS:
                negations += 1
            if folded in OPPOSITES:
                polar.add(folded)
            if (token[0].isupper() and not starts_sentence and folded not in DATE_WORDS
                    and folded not in NOT_NAMES):
                names.add(folded)
                order.setdefault(folded)
        # Parity, not count: "not ... not" reads as an affirmation again.
        return cls(frozenset(numbers), frozenset(dates), frozenset(units), frozenset(names),
                   tuple(order), negations % 2, frozenset(polar), frozenset(words),
                   tuple(content))


def _is_unit_context(text: str, end: int) -> bool:
    """Whether a "second" ending at `end` is the unit (a number before it, "per second")."""
    return bool(re.search(r"(\d|per|a)\s+seconds?$", text[:end], re.IGNORECASE))


def _negated_forms(only_a: frozenset[str], only_b: frozenset[str]) -> bool:
    """Whether a word of one side is the other's with a negating prefix (safe/unsafe)."""
    for word in only_a:
        for other in only_b:
            long, short = (word, other) if len(word) > len(other) else (other, word)
            # Four letters at least: "into" is not a negated "to".
            if len(short) >= 4 and any(long == p + short for p in _NEGATING_PREFIXES):
                return True
    return False
