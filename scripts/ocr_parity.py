"""The `ocr` reward's two backends side by side on rendered text: rapidocr (ONNX) vs paddleocr (Paddle), same models.

    python scripts/ocr_parity.py [--json OUT] [--markdown]      # in an environment with gerl[paddleocr]

Renders each case with PIL's built-in font (no system font), scores it with `ocr` under both backends — the full
pipeline (detector + recogniser) and `rec_only` on a text-line crop — and times each image (median of 3 calls after
a warm-up, 1 thread). Prints one line per case, then a summary line; exit 1 if any reading differs.
The paddleocr backend converts its models from rapidocr's ONNX files on first use (rewards/paddle_models.py); run it
with no network (`unshare -n`) to see it needs none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (rendered text, image size px, font size px, prompt's target, rec_only)
CASES = [
    ("Hello World", 128, 20, "Hello World", False),
    ("Hallo World", 128, 20, "Hello World", False),
    ("OPEN", 64, 14, "OPEN", False),
    ("GERL 2048", 128, 18, "GERL 2048", False),
    ("Flow-GRPO", 128, 18, "Flow-GRPO", False),
    ("SALE 50%", 96, 16, "SALE 50%", False),
    ("Coffee & Tea", 160, 18, "Coffee & Tea", False),
    ("The quick brown fox", 256, 18, "The quick brown fox", False),
    ("", 128, 20, "Hello", False),
    ("OPEN LATE", 160, 24, "OPEN LATE", True),
    ("2048", 160, 24, "2048", True),
    ("A1B2C3", 160, 24, "A1B2C3", True),
]


def render(text: str, size: int, font_size: int, line: bool):
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    left, top, right, bottom = draw.textbbox((0, 0), text or " ", font=font)
    draw.text(((size - (right - left)) / 2 - left, (size - (bottom - top)) / 2 - top), text, fill="black", font=font)
    return image.crop((0, size // 2 - 20, size, size // 2 + 20)) if line else image


def timed(reward, image, prompt, repeats: int = 3):
    from rewards.registry import call_reward

    call_reward(reward, [image], [prompt], [{}])  # warm-up (and the model load)
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = call_reward(reward, [image], [prompt], [{}])
        times.append(time.perf_counter() - t0)
    scores, extras = out
    return scores[0], extras["ocr_text"][0], statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    args = p.parse_args()
    from rewards.registry import build_reward

    t0 = time.perf_counter()
    rewards = {(b, r): build_reward("ocr", {"backend": b, "rec_only": r, "num_threads": 1})
               for b in ("rapidocr", "paddleocr") for r in (False, True)}
    rows = []
    for text, size, font_size, target, rec_only in CASES:
        image, prompt = render(text, size, font_size, rec_only), f'a sign that says "{target}"'
        row = {"rendered": text, "size": list(image.size), "target": target, "rec_only": rec_only}
        for backend in ("rapidocr", "paddleocr"):
            score, read, sec = timed(rewards[(backend, rec_only)], image, prompt)
            row[backend] = {"score": score, "text": read, "ms": round(1000 * sec, 1)}
        row["agree"] = row["rapidocr"]["text"] == row["paddleocr"]["text"]
        rows.append(row)
        print(f"{'rec_only' if rec_only else 'det+rec '} {text!r:24} {image.size[0]}x{image.size[1]}: "
              f"rapidocr {row['rapidocr']['text']!r} {row['rapidocr']['score']:.3f} {row['rapidocr']['ms']} ms | "
              f"paddleocr {row['paddleocr']['text']!r} {row['paddleocr']['score']:.3f} {row['paddleocr']['ms']} ms",
              flush=True)
    agree = sum(r["agree"] for r in rows)
    if args.markdown:
        print("\n| image | mode | target | rapidocr reads | score | ms | paddleocr reads | score | ms |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            a, b = r["rapidocr"], r["paddleocr"]
            print(f"| {r['rendered'] or '(blank)'} {r['size'][0]}×{r['size'][1]} | "
                  f"{'rec_only' if r['rec_only'] else 'det+rec'} | {r['target']} | {a['text'] or '—'} | "
                  f"{a['score']:.3f} | {a['ms']} | {b['text'] or '—'} | {b['score']:.3f} | {b['ms']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, ensure_ascii=False))
    med = {b: round(statistics.median(r[b]["ms"] for r in rows), 1) for b in ("rapidocr", "paddleocr")}
    print(f"ocr_parity: {agree}/{len(rows)} readings agree; median ms/image rapidocr {med['rapidocr']}, paddleocr "
          f"{med['paddleocr']}; {time.perf_counter() - t0:.0f} s in all")
    return 0 if agree == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
