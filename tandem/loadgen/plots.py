"""PNG plots of one run or a comparison: latency CDFs side by side, and throughputs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tandem.loadgen.client import Result
from tandem.loadgen.report import samples


def plot(path: Path, labels: Sequence[str], runs: Sequence[Sequence[Result]], summaries: Sequence[dict],
         title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, metric, name in zip(axes.flat, ("ttft", "itl", "e2e"), ("TTFT", "inter-token latency", "end-to-end")):
        for label, results in zip(labels, runs):
            xs = sorted(x * 1000 for x in samples(results, metric))
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes.flat[3]
    keys = ("request_throughput", "goodput", "output_token_throughput")
    width = 0.8 / max(1, len(labels))
    for i, (label, s) in enumerate(zip(labels, summaries)):
        # Requests/s and goodput share a scale; tokens/s is divided by 100 to fit beside them.
        values = [s["request_throughput"], s["goodput"], s["output_token_throughput"] / 100]
        ax.bar([k + i * width for k in range(len(keys))], values, width, label=label)
    ax.set_xticks([k + width * (len(labels) - 1) / 2 for k in range(len(keys))],
                  ["req/s", "goodput req/s", "output tok/s / 100"])
    ax.set_title("throughput")
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
