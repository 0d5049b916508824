"""A synthetic encyclopedia for search agents: invented people, cities, countries and companies linked by relations,
rendered as one short passage each, with 1-hop and 2-hop questions whose answers need retrieval. Everything is drawn
from one seed, so the same seed gives the same corpus and questions in every process. The names are invented, so a
model cannot answer from memory: it has to search.

Also the loader for user QA files (JSONL with "question" and "golden_answers" or "answer").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from envs.data import read_jsonl

_ONSETS = ["b", "c", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kl", "st",
           "tr", "sh", "th", "pl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
_CODAS = ["", "", "n", "r", "s", "l", "th", "m"]
OCCUPATIONS = ["chemist", "painter", "architect", "engineer", "novelist", "astronomer", "composer", "surgeon",
               "botanist", "economist", "sculptor", "geologist"]
INDUSTRIES = ["robotics", "shipping", "textile", "software", "mining", "publishing", "aerospace", "pharmaceutical",
              "furniture", "energy"]
_COMPANY_SUFFIXES = ["Labs", "Works", "Industries", "Group", "Systems", "Holdings"]


@dataclass(frozen=True)
class Question:
    """A question, its accepted answers, and (for generated ones) the queries an expert searches, one per hop."""

    question: str
    answers: tuple[str, ...]
    hops: tuple[str, ...] = ()


@dataclass
class Encyclopedia:
    titles: list[str] = field(default_factory=list)
    passages: list[str] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)


def _name(rng: np.random.Generator, syllables: int) -> str:
    parts = [_ONSETS[rng.integers(len(_ONSETS))] + _VOWELS[rng.integers(len(_VOWELS))] for _ in range(syllables)]
    return ("".join(parts) + _CODAS[rng.integers(len(_CODAS))]).capitalize()


def _unique_names(rng: np.random.Generator, n: int, syllables: tuple[int, ...], taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = _name(rng, int(syllables[rng.integers(len(syllables))]))
        if name.lower() not in taken:
            taken.add(name.lower())
            out.append(name)
    return out


@functools.lru_cache(maxsize=4)
def build_encyclopedia(seed: int = 0, n_people: int = 120, n_cities: int = 40, n_countries: int = 10,
                       n_companies: int = 40) -> Encyclopedia:
    """The corpus and its questions for `seed` (cached per process; treat the result as read-only)."""
    rng = np.random.default_rng(seed)
    taken: set[str] = set()
    countries = _unique_names(rng, n_countries, (2, 3), taken)
    cities = _unique_names(rng, n_cities, (2, 3), taken)
    firsts = _unique_names(rng, n_people, (2,), taken)
    lasts = _unique_names(rng, n_people, (2, 3), taken)
    people = [f"{f} {s}" for f, s in zip(firsts, lasts, strict=True)]  # every first and last name is unique: no ambiguity
    companies = [f"{n} {_COMPANY_SUFFIXES[rng.integers(len(_COMPANY_SUFFIXES))]}"
                 for n in _unique_names(rng, n_companies, (2, 3), taken)]

    city_country = {c: countries[rng.integers(n_countries)] for c in cities}
    city_founded = {c: int(rng.integers(900, 1900)) for c in cities}
    city_population = {c: int(rng.integers(20, 2000)) * 1000 for c in cities}
    person_city = {p: cities[rng.integers(n_cities)] for p in people}
    person_year = {p: int(rng.integers(1900, 2000)) for p in people}
    person_job = {p: OCCUPATIONS[rng.integers(len(OCCUPATIONS))] for p in people}
    founders = [people[i] for i in rng.permutation(n_people)[:n_companies]]  # each founder founds one company
    company_founder = dict(zip(companies, founders, strict=True))
    company_city = {c: cities[rng.integers(n_cities)] for c in companies}
    company_year = {c: int(rng.integers(1950, 2020)) for c in companies}
    company_industry = {c: INDUSTRIES[rng.integers(len(INDUSTRIES))] for c in companies}
    person_company = {p: companies[rng.integers(n_companies)] for p in people}
    for c, f in company_founder.items():
        person_company[f] = c

    enc = Encyclopedia()

    def add(title: str, text: str) -> None:
        enc.titles.append(title)
        enc.passages.append(f"{title}: {text}")

    for country in countries:
        members = sorted(c for c in cities if city_country[c] == country)
        listed = ", ".join(members) if members else "no large cities"
        add(country, f"{country} is a country. Its cities include {listed}.")
    for city in cities:
        add(city, f"{city} is a city in {city_country[city]}. It was founded in {city_founded[city]} and has a "
                  f"population of {city_population[city]}.")
    for p in people:
        article = "an" if person_job[p][0] in "aeiou" else "a"
        add(p, f"{p} (born {person_year[p]}) is {article} {person_job[p]} who was born in {person_city[p]}. "
               f"{p.split()[0]} works at {person_company[p]}.")
    for c in companies:
        article = "an" if company_industry[c][0] in "aeiou" else "a"
        add(c, f"{c} is {article} {company_industry[c]} company founded in {company_year[c]} by {company_founder[c]}. "
               f"It is headquartered in {company_city[c]}.")

    qs: list[Question] = []
    for p in people:
        city, company = person_city[p], person_company[p]
        qs += [
            Question(f"In which city was {p} born?", (city,), (f"{p} born",)),
            Question(f"In what year was {p} born?", (str(person_year[p]),), (f"{p} born",)),
            Question(f"What is the occupation of {p}?", (person_job[p],), (f"{p}",)),
            Question(f"In which country was {p} born?", (city_country[city],), (f"{p} born", f"{city} country")),
            Question(f"In which city is the company that {p} works for headquartered?", (company_city[company],),
                     (f"{p} works at", f"{company} headquartered")),
            Question(f"What is the population of the city where {p} was born?", (str(city_population[city]),),
                     (f"{p} born", f"{city} population")),
        ]
    for c in companies:
        f = company_founder[c]
        qs += [
            Question(f"Who founded {c}?", (f,), (f"{c} founded",)),
            Question(f"In what year was {c} founded?", (str(company_year[c]),), (f"{c} founded",)),
            Question(f"In what year was the founder of {c} born?", (str(person_year[f]),),
                     (f"{c} founded by", f"{f} born")),
            Question(f"In which country is {c} headquartered?", (city_country[company_city[c]],),
                     (f"{c} headquartered", f"{company_city[c]} country")),
        ]
    for city in cities:
        qs.append(Question(f"In which country is {city}?", (city_country[city],), (f"{city} country",)))
    order = rng.permutation(len(qs))
    enc.questions = [qs[i] for i in order]
    return enc


def load_qa(path: str | Path) -> list[Question]:
    """Questions of a JSONL file: "question" plus "golden_answers" (a list, as in FlashRAG / Search-R1 data) or
    "answer" (a string or a list)."""
    out = []
    for i, row in enumerate(read_jsonl(path)):
        answers = row.get("golden_answers", row.get("answer"))
        if "question" not in row or answers is None:
            raise ValueError(f"{path}: row {i} needs 'question' and 'golden_answers' or 'answer'")
        answers = [answers] if isinstance(answers, (str, int, float)) else list(answers)
        if not answers:
            raise ValueError(f"{path}: row {i} has no answer")
        out.append(Question(str(row["question"]), tuple(str(a) for a in answers)))
    if not out:
        raise ValueError(f"{path}: no questions")
    return out
