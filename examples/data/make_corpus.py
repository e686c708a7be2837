"""Write corpus.txt: a small synthetic English-like text with structure a tiny GPT learns in minutes.

Deterministic (seeded), no downloads. Sentences follow a few templates over a fixed vocabulary;
facts (who lives where, what each animal eats) are consistent across the text, and sums are right,
so a model can lower its loss by learning spelling, grammar, facts and a little arithmetic.

    python examples/data/make_corpus.py            # rewrites examples/data/corpus.txt
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Ada", "Ben", "Cleo", "Dmitri", "Eva", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Leo"]
TOWNS = ["Ashford", "Brookvale", "Cedarport", "Dunmore", "Elmstead", "Fairhaven"]
ANIMALS = {"fox": "berries", "owl": "mice", "goat": "grass", "otter": "fish", "bear": "honey", "crow": "seeds"}
ADJS = ["quiet", "bright", "old", "small", "busy", "green", "cold", "warm", "tall", "gentle"]
PLACES = ["river", "hill", "market", "library", "harbor", "forest", "bridge", "garden"]
VERBS = ["walks to", "looks at", "paints", "reads near", "waits by", "sings at", "runs past"]
TIMES = ["in the morning", "at noon", "in the evening", "at night", "on Sunday", "after the rain"]


def sentences(rng: random.Random):
    home = {n: rng.choice(TOWNS) for n in NAMES}
    while True:
        kind = rng.randrange(6)
        n = rng.choice(NAMES)
        if kind == 0:
            yield f"{n} lives in {home[n]}."
        elif kind == 1:
            a = rng.choice(list(ANIMALS))
            yield f"The {rng.choice(ADJS)} {a} eats {ANIMALS[a]} {rng.choice(TIMES)}."
        elif kind == 2:
            yield f"{n} {rng.choice(VERBS)} the {rng.choice(ADJS)} {rng.choice(PLACES)} {rng.choice(TIMES)}."
        elif kind == 3:
            x, y = rng.randrange(10), rng.randrange(10)
            yield f"{n} counts {x} plus {y} and says {x + y}."
        elif kind == 4:
            m = rng.choice(NAMES)
            yield f"{n} and {m} meet at the {rng.choice(PLACES)} in {home[m]}, where {m} lives."
        else:
            a = rng.choice(list(ANIMALS))
            yield f"In {rng.choice(TOWNS)} the {a} is {rng.choice(ADJS)}, and it likes {ANIMALS[a]}."


def make(num_bytes: int = 200_000, seed: int = 0) -> str:
    rng = random.Random(seed)
    out, size, line = [], 0, []
    for s in sentences(rng):
        line.append(s)
        if rng.random() < 0.25:  # paragraphs of a few sentences
            text = " ".join(line) + "\n"
            out.append(text)
            size += len(text)
            line = []
            if size >= num_bytes:
                return "".join(out)


if __name__ == "__main__":
    path = Path(__file__).with_name("corpus.txt")
    path.write_text(make())
    print(f"wrote {path} ({path.stat().st_size} bytes)")
