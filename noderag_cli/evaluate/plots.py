"""The ablation figure: answer containment and support recall against context tokens, one line
per strategy (its points are the budgets). Headless: matplotlib's Agg backend, PNG out."""

from __future__ import annotations

from pathlib import Path

from ..files import write_output

PANELS = (("answer_containment", "answer containment"), ("support_recall", "support recall"))


def _style(name: str, kind: str, index: int):
    """ppr-1..ppr-10 as a thin sequential ramp, the full search bold black, the rest distinct."""
    from matplotlib import colormaps

    if name == "noderag":
        return {"color": "black", "linewidth": 2.6, "marker": "o", "zorder": 5}
    if name.startswith("ppr-") and name[4:].isdigit():
        return {"color": colormaps["viridis"](int(name[4:]) / 11), "linewidth": 0.9, "marker": ".", "alpha": 0.8}
    palette = colormaps["tab20"]
    markers = "sD^v<>pP*Xh"
    return {"color": palette(index % 20), "linewidth": 1.6, "marker": markers[index % len(markers)],
            "linestyle": "--" if kind == "baseline" else "-"}


def plot_ablation(rows: list[dict], path: Path, title: str = "NodeRAG ablations and baselines") -> Path:
    """Write the figure to `path` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(row["strategy"] for row in rows))
    figure, axes = plt.subplots(1, 2, figsize=(15, 6.2), constrained_layout=True)
    for position, name in enumerate(names):
        points = sorted((r for r in rows if r["strategy"] == name), key=lambda r: r["mean_context_tokens"])
        style = _style(name, points[0].get("kind", ""), position)
        for axis, (key, _label) in zip(axes, PANELS, strict=True):
            shown = [(r["mean_context_tokens"], r[key]) for r in points if r.get(key) is not None]
            if shown:
                axis.plot([x for x, _ in shown], [y for _, y in shown], label=name, **style)
    for axis, (_key, label) in zip(axes, PANELS, strict=True):
        axis.set_xlabel("mean context tokens")
        axis.set_ylabel(label)
        axis.set_title(f"{label} vs context tokens")
        axis.grid(True, alpha=0.3)
        axis.set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside right center", fontsize=8, frameon=False)
    figure.suptitle(title)
    path = Path(path)
    write_output(path, lambda handle: figure.savefig(handle, dpi=110, format="png"), "--out")
    plt.close(figure)
    return path
