#!/usr/bin/env python3
"""One- and two-step arithmetic word problems for `hol/wordproblems.hol` (the SmolLM2 GRPO example).

Writes `examples/data/wordproblems/train.jsonl` and `test.jsonl`: rows `{"question": ..., "expected": ...}`
with whole-number answers, drawn from a fixed seed so the files are the same on every machine. The held-out
problems are all different and never share a (template, numbers) pair with the training ones (which may repeat
numbers with other names and things), and both sets cover every template in turn, so that a gain on the test
set comes from the skill, not from having seen the problem.

    python3 scripts/word_problems.py [--train 2000] [--test 200] [--seed 0] [--out examples/data/wordproblems]

Only the standard library: it runs with any Python 3.8+.
"""

import argparse
import json
import random
from pathlib import Path

NAMES = ["Sam", "Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Lily", "Ben", "Nina", "Raj", "Emma", "Tom", "Sara"]
THINGS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells", "cards", "coins"]
CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("jar", "jars"), ("basket", "baskets"), ("shelf", "shelves")]


def pronoun(name):
    return "she" if name in {"Mia", "Ava", "Zoe", "Lily", "Nina", "Emma", "Sara"} else "he"


def add(rng):
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    q = f"{n} has {a} {t}. {pronoun(n).capitalize()} finds {b} more. How many {t} does {n} have now?"
    return ("add", a, b), q, a + b


def subtract(rng):
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    a = rng.randint(5, 40)
    b = rng.randint(1, a - 1)
    q = f"{n} had {a} {t} and gave {b} of them away. How many {t} does {n} have left?"
    return ("subtract", a, b), q, a - b


def multiply(rng):
    t = rng.choice(THINGS)
    one, many = rng.choice(CONTAINERS)
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    q = f"Each {one} holds {a} {t}. How many {t} are in {b} {many}?"
    return ("multiply", a, b), q, a * b


def divide(rng):
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    each, friends = rng.randint(2, 12), rng.randint(2, 9)
    q = (
        f"{n} shares {each * friends} {t} equally among {friends} friends. "
        f"How many {t} does each friend get?"
    )
    return ("divide", each, friends), q, each


def two_step(rng):
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(5, 20), rng.randint(2, 15)
    c = rng.randint(1, a + b - 1)
    q = (
        f"{n} has {a} {t}, buys {b} more, then gives {c} to a friend. "
        f"How many {t} does {n} have now?"
    )
    return ("two_step", a, b, c), q, a + b - c


TEMPLATES = [add, subtract, multiply, divide, two_step]


def draw(rng, count, held_out, unique):
    """`count` problems, cycling through the templates, none whose (template, numbers) key is in `held_out`;
    with `unique`, no key twice (and each one drawn is added to `held_out`)."""
    rows = []
    while len(rows) < count:
        key, question, answer = TEMPLATES[len(rows) % len(TEMPLATES)](rng)
        if key in held_out:
            continue
        if unique:
            held_out.add(key)
        rows.append({"question": question, "expected": str(answer)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "examples/data/wordproblems")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    held_out = set()
    test = draw(rng, args.test, held_out, unique=True)
    train = draw(rng, args.train, held_out, unique=False)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in [("train.jsonl", train), ("test.jsonl", test)]:
        with open(args.out / name, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} problems to {args.out / name}")


if __name__ == "__main__":
    main()
