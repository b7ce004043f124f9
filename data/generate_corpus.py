#!/usr/bin/env python3
"""Builds data/corpus.txt, the small text corpus of zero's examples.

Everything in the corpus was written for the zero project: data/prose.txt by hand, the rest
generated here from templates with a fixed seed, so the output is the same on every run.
Usage: python3 data/generate_corpus.py > data/corpus.txt   (Python 3.8+, standard library only)
"""
import random
import sys
from pathlib import Path

rng = random.Random(20240520)

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
        "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def words(n):
    """English words for 0 <= n < 1000."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    rest = n % 100
    return ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + words(rest))


ANIMALS = ["fox", "heron", "badger", "hare", "owl", "otter", "crow", "mole", "wren", "beaver",
           "tortoise", "squirrel", "goat", "mouse", "kingfisher", "hedgehog"]
PLACES = ["at the edge of the marsh", "under an old oak", "beside a slow river",
          "in a hollow on the hill", "behind the mill", "among the reeds",
          "near the crossroads", "in the orchard wall", "on a rocky island",
          "at the foot of the quarry"]
HABITS = ["counted the stones along the path", "listened to the wind in the grass",
          "gathered seeds and hid them in three places", "watched the clouds to guess the rain",
          "swam to the far bank and back", "visited each neighbour in turn",
          "sat very still until the sun was high", "repaired the walls of its home",
          "sang the same short song", "walked the boundary of its field"]
TROUBLES = ["a storm broke the bridge of branches", "the spring that fed the pond ran dry",
            "a stranger claimed the best hollow", "a hard frost killed the early shoots",
            "the path was lost under a fall of leaves", "the river rose and covered the stepping stones",
            "the seeds it had hidden were found by others", "a fire burned the far meadow"]
RESPONSES = [
    ("asked the others for help", "together they finished the work in a single day"),
    ("tried the same thing again and again", "at last it saw that the method, not the effort, was wrong"),
    ("sat down to think before doing anything", "the answer turned out to be simple"),
    ("followed the oldest path it knew", "the old path still led home"),
    ("made a careful list of what it had", "it found that it had enough after all"),
    ("shared what little food remained", "the others remembered this when the next winter came"),
    ("went to look at the problem closely", "it was smaller than it had seemed from far away"),
    ("waited and watched for three days", "the water fell as quickly as it had risen"),
]
MORALS = ["Haste counts the same stone twice.", "What is measured can be mended.",
          "A shared load is a light load.", "The map is not the field.",
          "Small steps, taken every day, cross mountains.", "Look before you mend.",
          "An old path is worth a new look.", "Enough is a number, not a feeling."]


def fable(i):
    a, b = rng.sample(ANIMALS, 2)
    place, habit, trouble = rng.choice(PLACES), rng.choice(HABITS), rng.choice(TROUBLES)
    act, result = rng.choice(RESPONSES)
    season = rng.choice(["spring", "summer", "autumn", "winter"])
    days = rng.randint(2, 30)
    return (f"FABLE {i}: THE {a.upper()} AND THE {b.upper()}\n\n"
            f"Once there was a {a} who lived {place}. Every morning the {a} {habit}. "
            f"Its neighbour, a {b}, laughed at this and said it was a waste of a good morning. "
            f"One {season}, {trouble}. The {b} ran in circles and complained to anyone who would listen. "
            f"The {a} {act}, and {result}. After {words(days)} days everything was as it had been, "
            f"and the {b} began, quietly, to copy the habits of the {a}.\n\n"
            f"Moral: {rng.choice(MORALS)}\n\n")


def arithmetic_lesson(i):
    lines = [f"LESSON {i}: NUMBERS\n"]
    for _ in range(10):
        op = rng.choice(["plus", "times", "minus"])
        if op == "plus":
            x, y = rng.randint(0, 499), rng.randint(0, 499)
            z = x + y
        elif op == "times":
            x, y = rng.randint(0, 31), rng.randint(0, 31)
            z = x * y
        else:
            x = rng.randint(0, 999)
            y = rng.randint(0, x)
            z = x - y
        lines.append(f"{x} {op} {y} is {z}. In words: {words(x)} {op} {words(y)} is {words(z)}.")
    n = rng.randint(2, 60)
    lines.append(f"Counting by {words(n if n < 20 else 2)}: " +
                 ", ".join(str(k * (n if n < 20 else 2)) for k in range(1, 11)) + ".")
    return "\n".join(lines) + "\n\n"


WINDS = ["north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west"]
SKIES = ["clear", "grey", "white with high cloud", "heavy and low", "bright after rain",
         "hazy", "streaked with mackerel cloud", "dark to the west"]
EVENTS = ["The fishing boats stayed in the harbour.", "Two ships passed heading south.",
          "Gulls gathered on the long rock at noon.", "The tide was higher than the tables said.",
          "Fog came in at dusk and lifted by midnight.", "A heron stood in the shallows all morning.",
          "Rain fell for an hour after dinner.", "The lamp was lit at half past six.",
          "The supply boat brought oil, flour and letters.", "Nothing passed all day."]


def ledger(year):
    lines = [f"FROM THE LEDGER, YEAR {year}\n"]
    for day in sorted(rng.sample(range(1, 366), 14)):
        temp = rng.randint(-4, 27)
        gulls = rng.randint(0, 120)
        lines.append(f"Day {day}. Wind from the {rng.choice(WINDS)}, force {rng.randint(0, 9)}. "
                     f"Sky {rng.choice(SKIES)}. Temperature {temp} degrees. Gulls on the rock: {gulls}. "
                     f"{rng.choice(EVENTS)}")
    return "\n".join(lines) + "\n\n"


ITEMS = [("flour", "sack", 4), ("oil", "jar", 7), ("nails", "box", 2), ("rope", "coil", 9),
         ("salt", "bag", 1), ("candles", "bundle", 3), ("wool", "bale", 12), ("apples", "basket", 5)]


def inventory(i):
    lines = [f"STOREHOUSE RECORD {i}\n"]
    total = 0
    for name, unit, price in rng.sample(ITEMS, 5):
        count = rng.randint(1, 20)
        total += count * price
        lines.append(f"{count} {unit}{'' if count == 1 else 's'} of {name} at {price} pence "
                     f"each: {count * price} pence.")
    lines.append(f"Total: {total} pence, or {total // 12} shillings and {total % 12} pence.")
    return "\n".join(lines) + "\n\n"


def main():
    prose = (Path(__file__).with_name("prose.txt")).read_text(encoding="utf-8").strip()
    out = [
        "A SMALL CORPUS FOR ZERO\n\n"
        "Written for the zero project and released under the project's licence. It holds short "
        "essays and stories, fables, number lessons, a lighthouse ledger and storehouse records.\n\n"
    ]
    out.append(prose + "\n\n")
    for i in range(1, 121):
        out.append(fable(i))
        if i % 2 == 1:
            out.append(arithmetic_lesson(i // 2 + 1))
        if i % 3 == 0:
            out.append(ledger(1890 + i // 3))
        if i % 2 == 0:
            out.append(inventory(i // 2))
    sys.stdout.write("".join(out))


if __name__ == "__main__":
    main()
