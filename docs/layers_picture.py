"""Draw dipc's layers (the import-linter ``layers`` contract in pyproject.toml) as docs/layers.png.

Usage: ``python docs/layers_picture.py [--out docs/layers.png]``.  Each box is a layer, top to bottom as the contract
lists them; a layer may import only the layers below it (the arrows), and modules in one box may import each other.
The picture is drawn from the contract itself, so it cannot drift from what ``tests/test_layers.py`` enforces.
"""
import argparse
import os
import textwrap
import tomllib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["tools", "public API", "runtime", "planner", "simulator", "program", "codegen", "passes", "capture", "IR"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "layers.png"))
    args = ap.parse_args()
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contract = tomllib.load(f)["tool"]["importlinter"]["contracts"][0]
    layers = contract["layers"]
    h, gap, w = 0.62, 0.38, 9.0
    fig, ax = plt.subplots(figsize=(10, 0.9 + len(layers) * (h + gap)))
    y = 0.0
    tops = []
    for i, layer in enumerate(layers):
        mods = [m.strip() for m in layer.replace("|", ":").split(":")]
        text = textwrap.fill(", ".join(mods), 95)
        name = NAMES[i] if i < len(NAMES) and len(NAMES) == len(layers) else f"layer {i}"
        ax.add_patch(FancyBboxPatch((0.0, y - h), w, h, boxstyle="round,pad=0.02", fc="#e8eef7", ec="#36558f"))
        ax.text(0.12, y - h / 2, name, ha="left", va="center", fontsize=10, weight="bold")
        ax.text(1.55, y - h / 2, text, ha="left", va="center", fontsize=7.5, family="monospace")
        tops.append(y)
        y -= h + gap
    for i in range(len(layers) - 1):
        ax.add_patch(FancyArrowPatch((w / 2, tops[i] - h - 0.02), (w / 2, tops[i + 1] + 0.04),
                                     arrowstyle="-|>", mutation_scale=12, color="#36558f"))
    ax.set_xlim(-0.1, w + 0.1)
    ax.set_ylim(y + gap - 0.1, 0.2)
    ax.axis("off")
    ax.set_title("dipc layers: each imports only the layers below it (import-linter, pyproject.toml)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
