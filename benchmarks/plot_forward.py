"""benchmarks/forward.png from bench_forward.py's JSON: forward seconds vs patches per image, one
panel per tower, ours and HF in each dtype; the title names the CPU (lscpu's model name), its
dot-relevant flags and the run's date. bench_forward.py calls `plot` at the end of a run; this script
redraws the picture from any run's JSON without running anything:

    python benchmarks/plot_forward.py [benchmarks/results/forward.json] [-o benchmarks/forward.png]

Needs matplotlib (not a dependency of the package: `pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "forward.json"
DEFAULT_PNG = ROOT / "benchmarks" / "forward.png"  # RESULTS.md shows this file


def title(run: dict) -> str:
    """Two lines from the JSON's machine record: the CPU, cores, date and medians; its dot flags."""
    m = run.get("machine", {})
    cpu = m.get("lscpu_model") or m.get("cpu") or "unknown CPU"
    date = (m.get("date") or "?")[:10]
    return (
        f"{cpu}, {m.get('cores', '?')} cores; {date}; medians of {run.get('repeats', '?')} calls x "
        f"{run.get('rounds', '?')} round(s)\nflags: {' '.join(m.get('cpu_flags', [])) or '-'}"
    )


def plot(run: dict, path: pathlib.Path) -> pathlib.Path:
    """Draw `run` (bench_forward's JSON, parsed) into `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = run["records"]
    variants = list(dict.fromkeys(r["variant"] for r in records))
    width = max(5.5 * len(variants), 9.0)  # room for the title's flag line with one panel
    fig, axes = plt.subplots(1, len(variants), figsize=(width, 4.6), squeeze=False)
    for ax, variant in zip(axes[0], variants):
        for impl, color in (("ours", "tab:blue"), ("HF", "tab:orange")):
            for dtype, style in (("float32", "-o"), ("bfloat16", "--s")):
                pts = sorted(
                    (r["patches"], r["seconds"])
                    for r in records
                    if (r["variant"], r["impl"], r["dtype"]) == (variant, impl, dtype)
                )
                if pts:
                    ax.plot(*zip(*pts), style, color=color, label=f"{impl} {dtype}")
        ax.set(title=variant, xlabel="patches per image", ylabel="forward seconds (median)", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title(run), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="?", default=str(DEFAULT_JSON), help="bench_forward.py's JSON output")
    ap.add_argument("-o", "--out", default=str(DEFAULT_PNG), help="PNG path")
    args = ap.parse_args()
    run = json.loads(pathlib.Path(args.json).read_text())
    print(f"wrote {plot(run, pathlib.Path(args.out))}")


if __name__ == "__main__":
    main()
