"""The Grafana dashboard's panels drawn from scraped /metrics samples, for scripts/docs_pictures.py:
the few PromQL forms docker/grafana-dashboard.json uses, evaluated over the samples as Prometheus
would (rate and increase over a RATE_WINDOW_S window, `sum by` the labels named, gauges as they
are), and every timeseries panel drawn with matplotlib in its gridPos layout."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

RATE_WINDOW_S = 10.0


_SELECTOR = r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?"  # the matchers ({job=~"$job"}) match our one job


def parse_promql(expr: str):
    """The few PromQL forms the dashboard uses: METRIC, rate(METRIC[..]), increase(METRIC[..]),
    and sum by (LABELS) (one of those)."""
    expr = expr.strip()
    if m := re.fullmatch(r"sum\s+by\s*\(([^)]*)\)\s*\((.*)\)", expr):
        return ("sum", tuple(x.strip() for x in m[1].split(",")), parse_promql(m[2]))
    if m := re.fullmatch(r"(rate|increase)\(\s*" + _SELECTOR + r"\s*\[[^\]]*\]\s*\)", expr):
        return (m[1], m[2])
    if m := re.fullmatch(_SELECTOR, expr):
        return ("gauge", m[1])
    raise ValueError(f"PromQL this script does not evaluate: {expr}")


class Series:
    """The scrapes as arrays: times, and per sample name, per label set, a value per scrape (NaN: absent)."""

    def __init__(self, scrapes: list[dict]):
        import numpy as np

        self.t = np.array([s["t"] for s in scrapes])
        self.by_name: dict[str, dict[tuple, np.ndarray]] = {}
        for i, s in enumerate(scrapes):
            for name, labels, value in s["samples"]:
                series = self.by_name.setdefault(name, {})
                key = tuple(sorted(labels.items()))
                if key not in series:
                    series[key] = np.full(len(scrapes), np.nan)
                series[key][i] = value

    def evaluate(self, node) -> dict[tuple, object]:
        import numpy as np

        kind = node[0]
        if kind == "gauge":
            return dict(self.by_name.get(node[1], {}))
        if kind in ("rate", "increase"):
            out = {}
            for key, values in self.by_name.get(node[1], {}).items():
                rate = np.full(len(self.t), np.nan)
                for i in range(len(self.t)):
                    since = self.t[i] - RATE_WINDOW_S - 0.05
                    w = [j for j in range(i + 1) if self.t[j] >= since and not math.isnan(values[j])]
                    if len(w) < 2:
                        continue
                    v = values[w]
                    diffs = np.diff(v)
                    grown = np.where(diffs >= 0, diffs, v[1:]).sum()  # a counter reset starts again at 0
                    rate[i] = grown / (self.t[w[-1]] - self.t[w[0]])
                out[key] = rate * RATE_WINDOW_S if kind == "increase" else rate
            return out
        if kind == "sum":
            _, by, inner = node
            groups: dict[tuple, list] = {}
            for key, values in self.evaluate(inner).items():
                labels = dict(key)
                groups.setdefault(tuple((b, labels[b]) for b in by if b in labels), []).append(values)
            out = {}
            for key, members in groups.items():
                stacked = np.vstack(members)
                total = np.nansum(stacked, axis=0)
                total[np.all(np.isnan(stacked), axis=0)] = np.nan
                out[key] = total
            return out
        raise ValueError(kind)


def legend_label(fmt: str, labels: dict) -> str:
    fmt = re.sub(r"\{\{\s*job\s*\}\}\s*", "", fmt)  # one job: its name is in the figure's title
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), fmt).strip()
    return text or ", ".join(f"{k}={v}" for k, v in labels.items() if k != "job") or "value"


def unit_of(defaults: dict) -> tuple[str, float]:
    """(y label, scale) for a Grafana unit."""
    unit = defaults.get("unit", "short")
    if unit == "percentunit":
        return "% of wall time (waited s per s)", 100.0
    if unit == "bytes":
        return "MiB", 1.0 / 2**20
    if unit == "ops":
        return "per second", 1.0
    if defaults.get("max") == 1:
        return "0 or 1 (count)", 1.0
    return "count", 1.0


def draw_dashboard(dashboard_path: Path, run: dict, png: Path, title: str) -> None:
    """Every timeseries panel of the Grafana dashboard at ``dashboard_path``, in its gridPos
    layout, drawn from ``run``'s scrapes (its "t0", "scrapes" and "pauses", shaded grey) into ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    dash = json.loads(dashboard_path.read_text())
    panels = [p for p in dash["panels"] if p.get("type") == "timeseries" and p.get("targets")]
    series = Series(run["scrapes"])
    x = series.t - run["t0"]
    if any("gridPos" not in p for p in panels):  # a 2-column grid in the panels' order
        for i, p in enumerate(panels):
            p["gridPos"] = {"x": 12 * (i % 2), "y": 8 * (i // 2), "w": 12, "h": 8}
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)

    fig = plt.figure(figsize=(14, 12), dpi=90, layout="constrained")
    grid = fig.add_gridspec(rows, 24)
    for p in panels:
        g = p["gridPos"]
        ax = fig.add_subplot(grid[g["y"] : g["y"] + g["h"], g["x"] : g["x"] + g["w"]])
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        ylabel, scale = unit_of(defaults)
        drawn, highest = 0, 0.0
        for target in p["targets"]:
            result = series.evaluate(parse_promql(target["expr"]))
            for key, values in sorted(result.items()):
                if np.all(np.isnan(values)):
                    continue
                ax.plot(x, values * scale, lw=1.4, label=legend_label(target.get("legendFormat", ""), dict(key)))
                drawn += 1
                highest = max(highest, float(np.nanmax(values)))
        for a, b in run["pauses"]:
            ax.axvspan(a - run["t0"], b - run["t0"], color="0.85", zorder=0, lw=0)
        if not drawn:
            ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", color="0.5")
        top = defaults.get("max")
        ax.set_ylim(bottom=0 if defaults.get("min") == 0 else None)
        if top is not None:
            ax.set_ylim(top=top * scale * 1.05)
        elif highest <= 0:
            ax.set_ylim(top=1)  # all zero: a flat line at the bottom, not matplotlib's +-0.05
        ax.set_xlim(0, x[-1] if len(x) else 1)
        ax.set_title(p["title"], fontsize=11, loc="left", fontweight="bold")
        ax.set_ylabel(ylabel, fontsize=9)
        below = -0.1
        if g["y"] + g["h"] == rows:  # the bottom row: the x label, the legend below it
            ax.set_xlabel("seconds since the trainers started", fontsize=9)
            below = -0.2
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if drawn:  # below the plot, as Grafana's legend placement "bottom"
            ax.legend(fontsize=8, ncol=min(drawn, 5), loc="upper left", bbox_to_anchor=(0, below), frameon=False)
    fig.suptitle(f"{title}; rate/increase over {RATE_WINDOW_S:g} s, scraped every 1 s", fontsize=11)
    fig.savefig(png, dpi=90)
    plt.close(fig)
