"""PNG charts of the latency distributions: for each of TTFT, TPOT, ITL and end-to-end
latency, a histogram and a CDF with one series per run. matplotlib is optional (the
`bench` extra) and imported only here, when charts are asked for."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from loadgen.runner import RunResult

METRICS = (
    ("ttft", "Time to first token", lambda r: [r.ttft]),
    ("tpot", "Time per output token", lambda r: [r.tpot] if r.tpot is not None else []),
    ("itl", "Inter-token latency", lambda r: r.itl),
    ("e2e", "End-to-end latency", lambda r: [r.e2e]),
)


def require_matplotlib() -> None:
    """Fails before the run, not after it, when charts cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'baton[bench]' (or matplotlib)") from None


def plot_latencies(runs: list[tuple[str, RunResult]], out_dir: Path) -> list[Path]:
    """One PNG per metric in `out_dir` (created); the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, title, values_of in METRICS:
        fig, (hist, cdf) = plt.subplots(1, 2, figsize=(11, 4))
        series = [(label, np.array([v * 1e3 for r in run.results if r.is_ok for v in values_of(r)]))
                  for label, run in runs]
        series = [(label, values) for label, values in series if values.size]
        # One set of bins for every run, so their bars compare.
        everything = np.concatenate([values for _, values in series]) if series else np.zeros(0)
        bins = np.histogram_bin_edges(everything, bins=min(50, max(10, everything.size // 5))) if series else 10
        for label, values in series:
            hist.hist(values, bins=bins, alpha=0.5, label=label)
            ordered = np.sort(values)
            cdf.plot(ordered, np.arange(1, ordered.size + 1) / ordered.size, label=label)
        hist.set(title=f"{title}: histogram", xlabel="ms", ylabel="count")
        cdf.set(title=f"{title}: CDF", xlabel="ms", ylabel="share of samples", ylim=(0, 1.02))
        for ax in (hist, cdf):
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
