"""The search agent's local corpus and its multi-hop questions, generated in code from a seed.

A fictional world: countries, cities (each in one country), people (each born in one city) and
companies (each founded by one person), one short page each, with an id
(``city-07``) and a title (the entity's name). Every name is a made-up word used once in the whole
world, so a question's answer is unambiguous and searching a name finds its page.

Questions take 1 to 3 lookups, each the search for a name the question or the last result gives::

    Birth country of the founder of Kelvoro Systems?   company -> person -> city -> country
    Birth city of the founder of Kelvoro Systems?      company -> person -> city
    Birth country of Velmora Quist?                    person -> city -> country
    Birth city of Velmora Quist?                       person -> city
    Country of Stelan?                                 city -> country

Each question ends with the name it starts from, and each page ends with the name its hop leads to (a
company's founder, a person's birthplace, a city's country): the name to search for next is always the
last one read. That is what lets a tiny model learn the loop: with page ids for names
(``named=False``) every copy is then of a fixed form at a fixed distance, as the calculator copies
its operands.

``corpus(seed)`` and ``questions(seed)`` are cached per process; ``dataset`` writes them as the files a
run reads.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

N_COUNTRIES, CITIES_PER_COUNTRY, N_PEOPLE, N_COMPANIES = 10, 4, 150, 60

INSTRUCTIONS = "One tool call a turn: <search>words</search>, <open>page id</open> or <answer>answer</answer>."

_ONSETS = [
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "br",
    "dr",
    "kr",
    "tr",
    "st",
    "gl",
    "pl",
    "sk",
    "th",
    "sh",
]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "k", "th", "x", "nd", "rt"]
_REGIONS = ["northern", "southern", "eastern", "western", "central"]
_PROFESSIONS = [
    "painter",
    "engineer",
    "chemist",
    "novelist",
    "architect",
    "economist",
    "composer",
    "surgeon",
    "botanist",
    "sculptor",
    "lawyer",
    "astronomer",
]
_INDUSTRIES = [
    ("software", "Systems"),
    ("robotics", "Robotics"),
    ("food", "Foods"),
    ("textile", "Textiles"),
    ("shipping", "Shipping"),
    ("energy", "Energy"),
    ("publishing", "Press"),
    ("aircraft", "Aeronautics"),
    ("chemicals", "Chemicals"),
    ("banking", "Bank"),
]
_SETTINGS = ["on a river", "on the coast", "in the mountains", "on a wide plain", "beside a lake", "in a valley"]


@dataclass(frozen=True)
class Page:
    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    hops: int
    path: tuple[str, ...]  # page ids along the hops; the last holds the answer


@dataclass(frozen=True)
class World:
    pages: tuple[Page, ...]
    questions: tuple[Question, ...]

    @functools.cached_property
    def by_id(self) -> dict[str, Page]:
        return {page.id: page for page in self.pages}


# Words of the pages and questions themselves (and English stop words): never a name.
_RESERVED = set(
    " ".join(
        [
            INSTRUCTIONS,
            *_REGIONS,
            *_PROFESSIONS,
            *(w for pair in _INDUSTRIES for w in pair),
            *_SETTINGS,
            "country part continent capital other cities million inhabitants city lies "
            "has about born birth was company founded headquarters are which founder with "
            "question there their these those where while about after before other",
        ]
    )
    .lower()
    .split()
)


class _Names:
    """Made-up words, each used once (compared in lower case: what BM25 sees)."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set(_RESERVED)

    def word(self) -> str:
        while True:
            syllables = self.rng.choice([2, 2, 3])
            word = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
            word += self.rng.choice(_CODAS)
            if len(word) >= 5 and word not in self.used:
                self.used.add(word)
                return word.capitalize()


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


@functools.lru_cache(maxsize=8)
def build_world(seed: int = 0, named: bool = True) -> World:
    """The pages and questions of ``seed`` (the same on every machine and Python version: one
    ``random.Random`` drawn in a fixed order). ``named=False``: the same world with every entity called by
    its page id (``person-070`` was born in ``city-32``), names of a fixed form that a tiny model can copy
    from a question or a search result by position, as it copies a number."""
    rng = random.Random(f"areal-hpc-search-{seed}")
    names = _Names(rng)

    def called(page_id: str, name: str) -> str:  # the name is drawn either way: both worlds hold the same facts
        return name if named else page_id

    pages: list[Page] = []
    questions: list[Question] = []

    countries = [(f"country-{i:02d}", called(f"country-{i:02d}", names.word())) for i in range(N_COUNTRIES)]
    cities = []  # (id, name, country index)
    city_numbers = rng.sample(range(N_COUNTRIES * CITIES_PER_COUNTRY), N_COUNTRIES * CITIES_PER_COUNTRY)
    for c in range(N_COUNTRIES):  # numbered at random: which country city-07 is in differs between worlds
        for _ in range(CITIES_PER_COUNTRY):
            cid = f"city-{city_numbers[len(cities)]:02d}"
            cities.append((cid, called(cid, names.word()), c))
    for c, (cid, country) in enumerate(countries):
        own = [name for _, name, country_of in cities if country_of == c]
        pages.append(
            Page(
                cid,
                country,
                f"{country} is a country in the {rng.choice(_REGIONS)} part of the continent. "
                f"Its capital is {own[0]}; its other cities are {_join(own[1:])}. "
                f"{country} has about {rng.randint(2, 90)} million inhabitants.",
            )
        )
    for cid, city, c in cities:
        pages.append(Page(cid, city, f"{city} is a city {rng.choice(_SETTINGS)} in {countries[c][1]}."))

    people = []  # (id, name, city index)
    for i in range(N_PEOPLE):
        name, city = called(f"person-{i:03d}", f"{names.word()} {names.word()}"), rng.randrange(len(cities))
        people.append((f"person-{i:03d}", name, city))
        profession = rng.choice(_PROFESSIONS)
        pages.append(
            Page(
                people[-1][0],
                name,
                f"{name} is {_a(profession)} {profession} born in {cities[city][1]}.",
            )
        )

    for i in range(N_COMPANIES):
        industry, suffix = rng.choice(_INDUSTRIES)
        pid = f"company-{i:02d}"
        name, founder = called(pid, f"{names.word()} {suffix}"), rng.randrange(N_PEOPLE)
        pages.append(Page(pid, name, f"{name} is {_a(industry)} {industry} company founded by {people[founder][1]}."))
        fid, _, born = people[founder]
        city, country = cities[born], countries[cities[born][2]]
        questions += [
            Question(f"Birth country of the founder of {name}?", country[1], 3, (pid, fid, city[0], country[0])),
            Question(f"Birth city of the founder of {name}?", city[1], 2, (pid, fid, city[0])),
        ]
    for pid, name, born in people:
        city, country = cities[born], countries[cities[born][2]]
        questions += [
            Question(f"Birth country of {name}?", country[1], 2, (pid, city[0], country[0])),
            Question(f"Birth city of {name}?", city[1], 1, (pid, city[0])),
        ]
    for cid, city, c in cities:
        questions.append(Question(f"Country of {city}?", countries[c][1], 1, (cid, countries[c][0])))
    return World(tuple(pages), tuple(questions))


def corpus(seed: int = 0, named: bool = True) -> tuple[Page, ...]:
    return build_world(seed, named).pages


def questions(seed: int = 0, named: bool = True) -> tuple[Question, ...]:
    return build_world(seed, named).questions


def prompt_of(question: str) -> str:
    return f"{INSTRUCTIONS}\nQuestion: {question}"
