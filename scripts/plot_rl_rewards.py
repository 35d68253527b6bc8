"""Draw the reward curve of `titanctl rl` runs from their metrics.jsonl files, as a PNG (docs/rl.md's figure).

Each run is one line: its reward_mean per step, smoothed over a window of steps (the raw values are
noisy: one rollout's prompts), in the run's own colour, with its name (the dump folder's) in the legend.
Drawn with Pillow (a dependency of tensorboard, so in titanctl's environment).

Usage: python scripts/plot_rl_rewards.py OUT.png RUN_FOLDER [RUN_FOLDER ...] [--window 10] [--key reward_mean]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw

WIDTH, HEIGHT, MARGIN = 720, 400, 56
COLOURS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]


def read(folder: Path, key: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r[key] for r in rows if isinstance(r.get(key), (int, float))}
    return sorted(by_step.items())


def smooth(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def plot(runs: dict[str, list[tuple[int, float]]], out: Path, window: int, key: str) -> None:
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    steps = max(step for run in runs.values() for step, _ in run)
    low = min(0.0, min(v for run in runs.values() for _, v in run))
    high = max(1.0, max(v for run in runs.values() for _, v in run))
    left, top, right, bottom = MARGIN, 20, WIDTH - 20, HEIGHT - MARGIN

    def xy(step: float, value: float) -> tuple[float, float]:
        return (left + (right - left) * (step - 1) / max(1, steps - 1),
                bottom - (bottom - top) * (value - low) / (high - low))

    for i in range(6):  # grid and labels
        value = low + (high - low) * i / 5
        y = xy(1, value)[1]
        draw.line([(left, y), (right, y)], fill=(225, 225, 225))
        draw.text((6, y - 6), f"{value:.2f}", fill="black")
    for i in range(6):
        step = 1 + (steps - 1) * i / 5
        x = xy(step, low)[0]
        draw.text((x - 8, bottom + 6), f"{step:.0f}", fill="black")
    draw.rectangle([left, top, right, bottom], outline="black")
    draw.text(((left + right) // 2 - 40, HEIGHT - 22), "policy update (step)", fill="black")
    draw.text((left + 6, top + 4), f"{key}, mean of {window} steps", fill="black")
    for n, (name, run) in enumerate(runs.items()):
        colour = COLOURS[n % len(COLOURS)]
        values = smooth([v for _, v in run], window)
        draw.line([xy(step, v) for (step, _), v in zip(run, values)], fill=colour, width=2)
        draw.text((right - 200, bottom - 8 - 14 * (len(runs) - n)), f"-- {name}", fill=colour)  # below rewards
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--key", default="reward_mean")
    args = parser.parse_args()
    plot({folder.name: read(folder, args.key) for folder in args.runs}, args.out, args.window, args.key)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
