"""A repeated-template workload: the kind of traffic a deployment's drafter can learn from.

Agent-style requests (tool calls as JSON, SQL over small schemas, field extraction) built
from a few templates with varied fillers, like the agent suite's prompts
(`suites/agent.txt`) and the requests an application sends all day. `prompts(n,
seed)` gives n distinct prompts, shuffled by the seed; `rounds(k, n, seed)` cuts k rounds of
n new prompts each, no prompt in two rounds, so every round's prompts are held out from
whatever was trained on the rounds before it.
"""

from __future__ import annotations

import itertools
import json
import random

CITIES = ["Paris", "Berlin", "Rome", "Madrid", "Lisbon", "Vienna", "Prague", "Oslo", "Dublin", "Athens",
          "Warsaw", "Zurich", "Tokyo", "Seoul", "Toronto", "Boston"]
UNITS = ["celsius", "fahrenheit"]
TOOLS = [
    ("get_weather", lambda r: {"city": r.choice(CITIES), "unit": r.choice(UNITS)}),
    ("search_flights", lambda r: {"from": r.choice(CITIES), "to": r.choice(CITIES),
                                  "date": f"2025-0{r.randint(1, 9)}-1{r.randint(0, 9)}", "adults": r.randint(1, 4)}),
    ("book_hotel", lambda r: {"city": r.choice(CITIES), "nights": r.randint(1, 7), "guests": r.randint(1, 3)}),
    ("send_email", lambda r: {"to": f"{r.choice(NAMES).lower()}@example.com",
                              "subject": r.choice(SUBJECTS)}),
    ("create_issue", lambda r: {"title": r.choice(BUGS), "labels": ["bug", r.choice(["ui", "api", "db"])]}),
    ("convert_currency", lambda r: {"amount": r.randint(5, 500), "from": r.choice(CURRENCIES),
                                    "to": r.choice(CURRENCIES)}),
]
NAMES = ["Dana", "Lee", "Omar", "Priya", "Jonas", "Mia", "Chen", "Sofia", "Liam", "Ava", "Noah", "Zoe"]
SUBJECTS = ["standup moved", "invoice attached", "lunch on Friday", "release notes", "weekly report"]
BUGS = ["login fails on Safari", "export drops the last row", "search ignores accents", "dark mode flickers"]
CURRENCIES = ["EUR", "USD", "GBP", "JPY", "CHF"]
TABLES = [
    ("customers(id, name, country)", "orders(id, customer_id, amount, created_at)", "customers", "orders"),
    ("authors(id, name)", "books(id, author_id, title, price, published)", "authors", "books"),
    ("departments(id, name)", "employees(id, dept_id, name, salary, hired_at)", "departments", "employees"),
    ("stores(id, city)", "sales(id, store_id, total, sold_at)", "stores", "sales"),
    ("users(id, email, created_at)", "logins(id, user_id, at, ip)", "users", "logins"),
]
SQL_ASKS = ["the {n} {parents} with the highest total {child_amount}", "how many {children} each of the {parents} has",
            "the {parents} that have no {children}", "the average {child_amount} per {parent}",
            "{children} from the last {n} days with their {parent}"]
AMOUNTS = {"orders": "amount", "books": "price", "employees": "salary", "sales": "total", "logins": "ip count"}
PEOPLE = [("Dana Lee", "Acme Corp", "dana@acme.io"), ("Omar Haddad", "Globex", "omar@globex.com"),
          ("Priya Nair", "Initech", "priya@initech.dev"), ("Jonas Berg", "Umbrella", "jonas@umbrella.org"),
          ("Mia Rossi", "Hooli", "mia@hooli.it"), ("Chen Wei", "Stark Ltd", "chen@stark.co")]
PRODUCTS = [("Nimbus 3 headphones", 199, "euros"), ("Atlas desk lamp", 45, "dollars"),
            ("Orbit smart watch", 329, "pounds"), ("Terra hiking boots", 149, "euros"),
            ("Pixel drawing tablet", 89, "dollars"), ("Zephyr fan", 59, "francs")]


def _tool_call(r: random.Random) -> str:
    name, args = r.choice(TOOLS)
    return f"Return only a JSON object calling the tool {name} with arguments {json.dumps(args(r))}."


def _sql(r: random.Random) -> str:
    parents_decl, children_decl, parents, children = r.choice(TABLES)
    ask = r.choice(SQL_ASKS).format(n=r.choice([3, 5, 10, 20]), parents=parents, children=children,
                                    parent=parents[:-1], child_amount=AMOUNTS[children])
    return f"Write a SQL query that returns {ask}, from tables {parents_decl} and {children_decl}."


def _contact(r: random.Random) -> str:
    name, company, email = r.choice(PEOPLE)
    greeting = r.choice(["Hi", "Hello", "Good morning", "Hey there"])
    return (f'Produce a JSON object {{"name": ..., "email": ..., "company": ...}} extracted from: '
            f'"{greeting}, I\'m {name} from {company}, reach me at {email}".')


def _product(r: random.Random) -> str:
    product, price, currency = r.choice(PRODUCTS)
    price += r.choice([0, 10, 20, 50])
    return f'Extract product name, price and currency as JSON from: "The new {product} cost {price} {currency}."'


def _event(r: random.Random) -> str:
    title = r.choice(["Dentist", "Team sync", "Gym", "Code review", "Parent meeting", "Yoga"])
    return (f'Return a JSON object describing a calendar event: title "{title}", start 2025-0{r.randint(1, 9)}-'
            f'{r.randint(10, 28)}T{r.randint(8, 18):02d}:{r.choice(["00", "15", "30", "45"])}, duration '
            f'{r.choice([15, 30, 45, 60, 90])} minutes.')


TEMPLATES = (_tool_call, _sql, _contact, _product, _event)


def prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct prompts of the workload, in a seeded random order."""
    r = random.Random(seed)
    seen: dict[str, None] = {}
    for tries in itertools.count():
        if len(seen) >= n:
            break
        if tries > 200 * n:
            raise ValueError(f"the workload's templates give fewer than {n} distinct prompts")
        seen.setdefault(r.choice(TEMPLATES)(r), None)
    return list(seen)


def rounds(k: int, n: int, seed: int = 0) -> list[list[str]]:
    """k rounds of n new prompts each (no prompt in two rounds)."""
    every = prompts(k * n, seed)
    return [every[i * n : (i + 1) * n] for i in range(k)]
