"""Training prompts for the SmolLM2 drafts: code requests, two-turn chats and math word problems.

Sources (all offline and license-clean; see ``scripts/reproduce/DATA_SOURCES.md``):

- code: the CPython stdlib function requests of ``build_corpus.py`` (PSF), training split only;
- chat: the two-turn chitchat conversations of ``build_corpus.py`` (MIT), training split only;
- math: grade-school word problems generated here from templates (this project's own text, Apache-2.0).

The assistant turns are placeholders: ``dmtp regenerate`` rewrites them with SmolLM2 itself. Output:
``OUT/train_{code,chat,math}.jsonl`` (OpenAI ``messages``), deterministic for a given corpus and seed.

Usage::

    .venv/bin/python scripts/reproduce/smollm2/build_prompts.py --corpus outputs/corpus --out outputs/smollm2/prompts
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Diego",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kira",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
]
SAMPLE = {"code": 2500, "chat": 1500}  # sizes of the random samples the requested counts are taken from
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells", "cards", "eggs"]


def _problem(rng: random.Random) -> str:
    """One word problem from a random template with random names and numbers."""
    a, b = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    x, y, z = rng.randint(2, 40), rng.randint(2, 12), rng.randint(2, 9)
    price = rng.choice([0.25, 0.5, 1.5, 2, 3, 4.5, 5])
    templates = [
        f"{a} has {x} {item}. {b} gives {a} {y} bags with {z} {item} in each bag. How many {item} does {a} have now?",
        f"{a} buys {y} packs of {item}. Each pack costs ${price}. {a} pays with a $100 bill. How much change does "
        f"{a} get?",
        f"{a} had {x * z} {item} and shared them equally among {z} friends. Then each friend gave {y % 5 + 1} back. "
        f"How many {item} does {a} have now?",
        f"A shop sold {x} {item} on Monday, twice as many on Tuesday, and {y} fewer on Wednesday than on Tuesday. "
        f"How many {item} did the shop sell in the three days?",
        f"{a} reads {y} pages a day. The book has {x * 10} pages. After {z} days, how many pages are left?",
        f"{a} is {x} years old. {b} is {y} years older than {a}. In {z} years, what will be the sum of their ages?",
        f"A train travels {x * 5} km per hour for {z} hours, then {y * 5} km per hour for 2 hours. How far does it "
        f"travel in total?",
        f"{a} saves ${y} every week. {b} saves ${z} every week and already has ${x}. After how many weeks will "
        f"{a} have at least as much as {b}, if {a} starts from zero? Explain step by step.",
        f"A rectangle is {x} cm long and {y} cm wide. What are its area and its perimeter?",
        f"{a} scored {x}, {x + y}, and {x + z} points in three games. What was {a}'s average score?",
        f"{a} bakes {x} {item} and sells them for ${price} each. {a} spent ${y} on ingredients. How much profit "
        f"does {a} make?",
        f"There are {x} students in a class. {z} of every 10 students walk to school and the rest take the bus. "
        f"How many students take the bus? Round to the nearest whole number.",
        f"{a} runs {y} km every weekday and {z} km on Saturday. How many km does {a} run in 4 weeks?",
        f"A jar holds {x * 3} {item}. {a} takes a third of them and {b} takes {y} of what is left. How many {item} "
        f"remain in the jar?",
        f"A movie ticket costs ${z + 5} for adults and ${z} for children. {a} buys tickets for 2 adults and {y} "
        f"children. What is the total cost?",
        f"{a} works {y} hours a day, {z % 5 + 3} days a week, and earns ${x} per hour. How much does {a} earn in a "
        f"week?",
        f"A farmer has {x} chickens and {y} cows. How many legs do the animals have in total?",
        f"{a} had ${x * 10}. {a} spent a quarter of it on a jacket and ${y} on lunch. How much money is left?",
        f"A pool is filled at {z} liters per minute. How many minutes does it take to fill {x * z * 10} liters? "
        f"How many hours is that?",
        f"{a} is reading a {x * 20}-page book. On the first day {a} reads {y * 3} pages and then {z * 4} pages "
        f"every day after that. How many days does it take to finish the book?",
        f"The price of a box of {item} went up from ${x} to ${x + y}. By what percent did the price increase?",
        f"{a} and {b} share {x * 6} {item} in the ratio 1:2. How many {item} does each of them get?",
        f"A car uses {z} liters of fuel per 100 km. Fuel costs ${price} per liter. How much does a {x * 10} km trip "
        f"cost?",
        f"{a} plants {y} rows of trees with {z} trees in each row. {x % 7 + 1} trees do not survive. How many trees "
        f"are left?",
        f"A class collects {x} cans on Monday, {x + y} on Tuesday and twice Tuesday's amount on Wednesday. The goal "
        f"is {x * 10} cans. How many more cans are needed?",
        f"{a} is {z} times as old as {b}. In {y} years {b} will be {y + x % 10 + 2} years old. How old is {a} now?",
        f"A recipe needs {z} cups of flour for {y} cookies. How many cups of flour are needed for {y * x % 97 + y} "
        f"cookies?",
        f"{a} downloads a file of {x * 100} MB at {z * 5} MB per second. How long does the download take in "
        f"seconds and in minutes?",
        f"A square garden has a side of {x} meters. {a} puts a fence around it that costs ${z} per meter. What is "
        f"the cost of the fence?",
        f"{a} has {x} dollars and wants to buy {y} {item} that cost ${price} each. Does {a} have enough money, and "
        f"how much is left over or missing?",
    ]
    return rng.choice(templates)


def math_records(count: int, seed: int) -> list[dict]:
    """``count`` distinct word problems as one-turn chats (ids ``math/<seed>/<i>``)."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < count:
        question = _problem(rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"id": f"math/{seed}/{len(rows)}", "messages": [{"role": "user", "content": question}]})
    return rows


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    """Write the three prompt files."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="outputs/corpus", help="output folder of build_corpus.py")
    parser.add_argument("--out", default="outputs/smollm2/prompts")
    parser.add_argument("--code", type=int, default=500, help="code requests (at most 2,500)")
    parser.add_argument("--chat", type=int, default=250, help="two-turn chats (at most 1,500)")
    parser.add_argument("--math", type=int, default=800, help="math word problems")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    corpus, out = Path(args.corpus), Path(args.out)
    rng = random.Random(args.seed)
    # Fixed-size random samples, then the first N of each: a smaller N gives a prefix of a larger one's file.
    code = _read(corpus / "train_code_chat.jsonl")
    code = [{"id": r["id"], "messages": r["messages"][:1]} for r in rng.sample(code, min(SAMPLE["code"], len(code)))]
    chat = [r for r in _read(corpus / "train_chat_2turn.jsonl") if len(r["messages"]) == 3]
    chat = rng.sample(chat, min(SAMPLE["chat"], len(chat)))
    code, chat = code[: args.code], chat[: args.chat]
    _write(out / "train_code.jsonl", code)
    _write(out / "train_chat.jsonl", chat)
    _write(out / "train_math.jsonl", math_records(args.math, args.seed))
    print(f"{len(code)} code, {len(chat)} chat, {args.math} math prompts -> {out}")


if __name__ == "__main__":
    main()
