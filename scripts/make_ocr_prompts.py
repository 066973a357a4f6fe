"""Generate the OCR prompt set in Flow-GRPO's format: one prompt per line, the text to render in "double quotes".

    python scripts/make_ocr_prompts.py                    # writes assets/ocr/train.txt (2000) and test.txt (64)
    python scripts/make_ocr_prompts.py --seed 1 --train-size 5000 --out-dir /tmp/ocr

Scene templates x short target texts (1-3 words: stock shop-sign phrases plus seeded word combinations). The test
targets are disjoint from the train targets (compared case- and space-insensitively, as the OCR reward compares
them), so validation measures rendering of text the policy was never rewarded for. Same seed -> same files.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

# {t} is the target text; every template quotes it exactly once.
TEMPLATES = [
    'A neon sign on a brick wall that says "{t}"',
    'A wooden shop sign hanging over a door, carved with the words "{t}"',
    'A chalkboard menu outside a cafe with "{t}" written in white chalk',
    'A vintage travel poster with the title "{t}" in bold letters',
    'A coffee mug on a desk printed with the text "{t}"',
    'A birthday cake with "{t}" written in blue icing',
    'A street banner stretched between two lamp posts reading "{t}"',
    'A close-up of a T-shirt with "{t}" printed across the chest',
    'A hand-painted sign in a flower market that reads "{t}"',
    'A book cover on a library shelf titled "{t}"',
    'A movie theater marquee at night showing "{t}"',
    'A sticky note on a computer monitor that says "{t}"',
    'A road sign on a desert highway reading "{t}"',
    'A glowing billboard above a busy city street with the slogan "{t}"',
    'A handwritten letter on old paper beginning with "{t}"',
    'A protest placard held up in a crowd, saying "{t}"',
    'A cereal box on a kitchen counter with the brand name "{t}"',
    'A graffiti mural on a train wall spelling "{t}"',
    'A doormat in front of a red door with the words "{t}"',
    'A vintage postcard from the seaside with "{t}" in cursive',
    'A wine bottle label that reads "{t}"',
    'A minimalist logo on a white background with the word "{t}"',
    'A classroom whiteboard with "{t}" written in red marker',
    'A sandcastle on a beach with "{t}" written in the sand beside it',
    'A bakery window with "{t}" painted in gold letters',
    'A skateboard deck with the graphic text "{t}"',
    'A retro arcade screen flashing the words "{t}"',
    'A rocket on a launch pad with "{t}" painted on its side',
    'A knitted sweater with "{t}" stitched on the front',
    'A greeting card on a table that says "{t}"',
    'A wooden crate at a harbor stamped with "{t}"',
    'A license plate on a classic car that reads "{t}"',
    'A lighthouse at dusk with a banner saying "{t}"',
    'An open notebook with "{t}" written neatly on the page',
    'A subway station wall sign that reads "{t}"',
    'A cat sitting next to a cardboard sign that says "{t}"',
    'A poster for a music festival headlined "{t}"',
    'A cookie with "{t}" piped in pink frosting',
    'A mailbox on a country road with "{t}" painted on it',
    'A snowy mountain cabin with a carved sign reading "{t}"',
    'A robot holding a tablet that displays "{t}"',
    'A stone monument in a park engraved with "{t}"',
    'A food truck with "{t}" painted along its side',
    'A hot air balloon with "{t}" written across it',
    'A laptop sticker that says "{t}"',
    'A magazine cover with the headline "{t}"',
    'A pair of sneakers with "{t}" printed on the heel',
    'A lab door with a warning sign that reads "{t}"',
]

# Phrases a sign would plausibly carry; combined with generated ones below.
PHRASES = """
OPEN LATE|FRESH COFFEE|NO PARKING|SALE|WELCOME HOME|HAPPY BIRTHDAY|STAY WILD|THANK YOU|EXIT|GOOD VIBES ONLY|
HELLO WORLD|KEEP OUT|FREE WIFI|BOOKS|LIVE MUSIC|HOT SOUP|STOP|SLOW DOWN|DREAM BIG|CLOSED|PIZZA|BAKERY|
ICE COLD BEER|NIGHT OWL|SUNSET CAFE|MOON RIVER|GAME OVER|LEVEL UP|PLAY AGAIN|PRESS START|BE KIND|
LOVE YOU|MISS YOU|GET WELL SOON|BON VOYAGE|GOOD LUCK|CONGRATS|BEST DAD|BEST MOM|TACOS|FRESH FISH|
RAMEN BAR|TEA HOUSE|FLOWER SHOP|GARDEN|SECRET|DANGER|HIGH VOLTAGE|QUIET PLEASE|LIBRARY|MUSEUM|
CITY LIGHTS|OCEAN VIEW|MOUNTAIN AIR|FOREST TRAIL|ROUTE 66|PIER 39|ROOM 101|GATE 7|PLATFORM 9|
STAR TREK|SPACE CAMP|MARS BASE|DEEP SEA|NORTH POLE|SUMMER CAMP|WINTER SALE|SPRING FAIR|HARVEST|
MAGIC|WONDER|HOPE|PEACE|JOY|FOCUS|ENERGY|BALANCE|CHAOS|ORDER|FUTURE|PAST|NOW|TODAY|TOMORROW|
JUST DO IT|LESS IS MORE|TRY AGAIN|NEVER GIVE UP|YOU GOT THIS|ALL DAY|EVERY DAY|NO RULES|HOME SWEET HOME|
CAFE LUNA|BLUE MOON|RED PLANET|GOLDEN HOUR|SILVER LINING|IRON WILL|STONE AGE|NEON DREAMS|PAPER PLANES
"""

ADJECTIVES = """
fresh bright quiet golden silver tiny giant happy lucky sunny rainy wild calm brave clever cosmic electric
frozen hidden lazy magic midnight noble royal rusty sleepy smooth spicy sweet swift urban velvet vintage
wooden yellow purple crimson emerald little grand secret simple modern ancient bold gentle honest jolly
""".split()

NOUNS = """
garden river harbor castle rocket planet forest island meadow canyon bridge tower market bakery studio
kitchen window lantern compass anchor feather pebble thunder comet galaxy orbit robot pixel signal
engine ticket journey voyage summit valley desert ocean breeze ember spark shadow mirror puzzle riddle
melody rhythm poem story dragon tiger falcon otter panda fox wolf owl bear whale pepper lemon mango
cookie waffle noodle pretzel donut muffin
""".split()

VERBS = "visit explore follow catch build find save join taste chase hold keep grow read ride".split()
NUMBERS = "1 2 3 7 9 12 24 42 99 100 2025".split()


def make_targets(rng: random.Random) -> list[str]:
    """All distinct target texts (1-3 words), in a seeded random order."""
    pool = {p.strip() for p in PHRASES.replace("\n", "").split("|") if p.strip()}
    pool |= {w for w in NOUNS + ADJECTIVES}  # 1 word
    pool |= {f"{a} {n}" for a in ADJECTIVES for n in NOUNS if rng.random() < 0.08}  # 2 words
    pool |= {f"{v} the {n}" for v in VERBS for n in NOUNS if rng.random() < 0.12}  # 3 words
    pool |= {f"{a} {n} {d}" for a in ADJECTIVES for n in NOUNS for d in NUMBERS if rng.random() < 0.004}
    targets = sorted(pool)  # sort first: set order is not reproducible across processes
    rng.shuffle(targets)
    return [_style(t, rng) for t in targets]


def _style(text: str, rng: random.Random) -> str:
    r = rng.random()
    return text.upper() if r < 0.4 else text.title() if r < 0.9 else text.lower()


def _key(text: str) -> str:
    return "".join(text.split()).lower()  # how the OCR reward compares texts


def make_prompts(targets: list[str], size: int, rng: random.Random) -> list[str]:
    """`size` distinct prompts cycling through `targets`, each paired with a random template."""
    prompts: list[str] = []
    seen: set[str] = set()
    i = 0
    while len(prompts) < size:
        prompt = rng.choice(TEMPLATES).format(t=targets[i % len(targets)])
        i += 1
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
        if i > 100 * size:
            raise RuntimeError("too few templates x targets for the requested size")
    return prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--test-size", type=int, default=64)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parents[1] / "assets" / "ocr")
    args = parser.parse_args(argv)

    targets = make_targets(random.Random(args.seed))
    # De-duplicate by the reward's comparison key, then split: the first test-size targets are held out.
    unique = list({_key(t): t for t in targets}.values())
    test_targets, train_targets = unique[: args.test_size], unique[args.test_size :]
    assert not {_key(t) for t in test_targets} & {_key(t) for t in train_targets}

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, tgts, size in (("train", train_targets, args.train_size), ("test", test_targets, args.test_size)):
        # Each split has its own stream, so the test split does not change with --train-size.
        lines = make_prompts(tgts, size, random.Random(f"{args.seed}:{name}"))
        (args.out_dir / f"{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {len(lines)} prompts ({min(len(tgts), size)} distinct targets) to {args.out_dir / f'{name}.txt'}")


if __name__ == "__main__":
    main()
