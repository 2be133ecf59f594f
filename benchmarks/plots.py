"""PNG plots of a comparison (matplotlib, Agg backend, no display needed):

- `cdf-<class>.png`: empirical CDFs of TTFT, TPOT and E2E latency for one class, a line per
  target (completed requests only; the legend gives how many of those sent completed).
- `ttft-over-time.png`: one panel per target, TTFT of every completed request against its send
  time (log scale, a colour per class), with the arrivals per second of each class overlaid
  on a second axis, so a surge and its effect on each class line up.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.metrics import tpot_ms
from benchmarks.outputs import bulk_dir
from benchmarks.records import TargetResult
from benchmarks.report import safe_name
from router.simulate.scenario import Scenario

__all__ = ["write_plots"]

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _cdf(ax: object, values: Sequence[float], label: str, color: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values, dtype=np.float64))
    ys = np.arange(1, xs.size + 1) / xs.size
    ax.step(xs, ys, where="post", label=label, color=color)  # type: ignore[attr-defined]


def write_plots(out_dir: Path, scenario: Scenario, results: Sequence[TargetResult]) -> list[str]:
    """Write the PNGs into `bulk_dir(out_dir)` (not committed under `benchmarks/results/`);
    returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = bulk_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    for spec in scenario.classes:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for i, result in enumerate(results):
            color = _COLORS[i % len(_COLORS)]
            sent = [r for r in result.requests if r.class_name == spec.name]
            ok = [r for r in sent if r.ok]
            label = f"{result.name} ({len(ok)}/{len(sent)} ok)"
            _cdf(axes[0], [r.ttft_ms for r in ok if r.ttft_ms is not None], label, color)
            _cdf(axes[1], [t for r in ok if (t := tpot_ms(r)) is not None], label, color)
            _cdf(axes[2], [r.e2e_ms for r in ok if r.e2e_ms is not None], label, color)
        slo = spec.slo.as_dict()
        for ax, (title, key) in zip(
            axes, (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E latency", "e2e_ms")), strict=True
        ):
            ax.set_title(f"{spec.name}: {title}")
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of completed requests")
            ax.set_xscale("log")
            ax.grid(True, which="both", alpha=0.3)
            if key in slo:
                ax.axvline(
                    slo[key],
                    color="black",
                    linestyle="--",
                    linewidth=1,
                    label=f"SLO {slo[key]:g} ms",
                )
            ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        name = f"cdf-{safe_name(spec.name)}.png"
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)

    n = max(1, len(results))
    fig, axes = plt.subplots(n, 1, figsize=(12, 3.6 * n), sharex=True, squeeze=False)
    horizon_s = max([scenario.duration_s] + [r.wall_s for r in results])
    bin_s = max(1.0, round(horizon_s / 60.0))  # ~60 bins: readable rates, not 1-s noise
    bins = np.arange(0.0, horizon_s + bin_s, bin_s)
    for ax, result in zip(axes[:, 0], results, strict=False):
        twin = ax.twinx()
        for j, spec in enumerate(scenario.classes):
            color = _COLORS[j % len(_COLORS)]
            recs = [r for r in result.requests if r.class_name == spec.name]
            ok = [r for r in recs if r.ok and r.ttft_ms is not None]
            ax.scatter(
                [r.send_s for r in ok],
                [r.ttft_ms for r in ok],
                s=6,
                alpha=0.6,
                color=color,
                label=f"{spec.name} TTFT",
            )
            failed = [r for r in recs if not r.ok]
            if failed:
                ax.scatter(
                    [r.send_s for r in failed],
                    [1.0] * len(failed),
                    marker="x",
                    s=14,
                    color=color,
                    label=f"{spec.name} failed/rejected",
                )
            counts, _ = np.histogram([r.send_s for r in recs], bins=bins)
            twin.step(
                bins[:-1],
                counts / bin_s,
                where="post",
                color=color,
                alpha=0.35,
                linewidth=1.2,
                label=f"{spec.name} sent/s",
            )
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (ms)")
        twin.set_ylabel(f"requests sent per second ({bin_s:g} s bins)")
        ax.set_title(f"{result.name}: TTFT over time, arrivals overlaid")
        ax.grid(True, which="both", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        h2, l2 = twin.get_legend_handles_labels()
        ax.legend(handles + h2, labels + l2, fontsize=7, loc="upper left", ncol=2)
    axes[-1, 0].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(out_dir / "ttft-over-time.png", dpi=110)
    plt.close(fig)
    written.append("ttft-over-time.png")
    return written
