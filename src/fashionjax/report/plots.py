"""PNG figures (matplotlib, Agg) from plain arrays and records; no JAX here."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from fashionjax import artifacts, figures  # noqa: E402

RIGHT, WRONG, NEUTRAL = "#1a7f37", "#d1242f", "#1f2328"
LOSS_COLOR, ACCURACY_COLOR = "#0969da", "#1a7f37"


def _save(fig, path: str | Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    artifacts.atomic_write_bytes(path, buffer.getvalue())
    return Path(path)


def samples(images_u8: np.ndarray, labels: np.ndarray, class_names: Sequence[str], path) -> Path:
    """One training example per class (black where a class has none), 2 x 5, titled with the class name."""
    firsts = [np.flatnonzero(labels == label)[:1] for label in range(len(class_names))]
    shown = np.stack([images_u8[first[0]] if len(first) else np.zeros(images_u8.shape[1:], np.uint8) for first in firsts])
    return titled_grid(shown, list(class_names), [NEUTRAL] * len(class_names), path,
                       "One Fashion-MNIST example per class", columns=5, rows=2)


def curve(records: Sequence[dict], path) -> Path:
    """Training loss and batch accuracy against step, on two axes."""
    steps = [r["step"] for r in records]
    fig, loss_axis = plt.subplots(figsize=(8, 4))
    loss_axis.plot(steps, [r["loss"] for r in records], marker="o", markersize=3, color=LOSS_COLOR)
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss", color=LOSS_COLOR)
    loss_axis.tick_params(axis="y", labelcolor=LOSS_COLOR)
    loss_axis.grid(True, alpha=0.25)
    accuracy_axis = loss_axis.twinx()
    accuracy_axis.plot(steps, [r["accuracy"] for r in records], marker="s", markersize=3, color=ACCURACY_COLOR)
    accuracy_axis.set_ylabel("batch accuracy", color=ACCURACY_COLOR)
    accuracy_axis.tick_params(axis="y", labelcolor=ACCURACY_COLOR)
    accuracy_axis.set_ylim(0.0, 1.0)
    fig.suptitle("Fashion-MNIST training curve")
    fig.tight_layout()
    return _save(fig, path)


def confusion(counts: np.ndarray, class_names: Sequence[str], path) -> Path:
    """Row-normalised confusion matrix with percentages."""
    counts = np.asarray(counts, dtype=np.float64)
    fractions = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    ticks = np.arange(len(class_names))
    fig, ax = plt.subplots(figsize=(8, 7))
    image = ax.imshow(fractions, cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_xticks(ticks, class_names, rotation=45, ha="right")
    ax.set_yticks(ticks, class_names)
    ax.set_xlabel("Predicted label")
    ax.set_ylabel("True label")
    ax.set_title("Fashion-MNIST confusion matrix (all test images)")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="fraction of true class")
    for i in ticks:
        for j in ticks:
            value = fractions[i, j]
            if value >= 0.01 or i == j:
                ax.text(j, i, f"{100 * value:.0f}%", ha="center", va="center", fontsize=8,
                        color="white" if value > 0.45 else "black")
    fig.tight_layout()
    return _save(fig, path)


def image_grid(images_u8: np.ndarray, true_labels, predicted, class_names: Sequence[str], path,
               title: str, notes: Sequence[str] | None = None) -> Path:
    """5 x 5 images titled with predicted and true names, green when right, red when wrong."""
    shown = range(min(len(images_u8), 25))
    titles = [f"pred: {class_names[int(predicted[k])]}\ntrue: {class_names[int(true_labels[k])]}"
              + (f"\n{notes[k]}" if notes is not None else "") for k in shown]
    colors = [RIGHT if int(true_labels[k]) == int(predicted[k]) else WRONG for k in shown]
    return titled_grid(images_u8[:25], titles, colors, path, title, columns=5, rows=5)


GRID_CELL = (44, 35)  # a grid cell in image pixels (rows, columns): a 28 x 28 image under 14 rows of title
GRID_INCH = 1.6 / 28  # inches per image pixel: each image is 1.6 inches wide


def titled_grid(images_u8: np.ndarray, titles: Sequence[str], colors: Sequence[str], path, title: str,
                columns: int | None = None, rows: int | None = None) -> Path:
    """Images (n, 28, 28) in a grid, each with its own title and title colour.

    The grid is one tiled image (white between cells) with the titles as figure text: axes per image,
    their titles and tight_layout took ~2 s for a 5 x 5 grid."""
    images_u8 = np.asarray(images_u8)
    columns = columns or min(len(images_u8), 6) or 1
    rows = rows or max(-(-len(images_u8) // columns), 1)
    (cell_rows, cell_columns), side = GRID_CELL, images_u8.shape[-1]
    canvas = np.full((rows * cell_rows, columns * cell_columns), 255, np.uint8)  # white between the images
    grid_height, width = canvas.shape[0] * GRID_INCH, canvas.shape[1] * GRID_INCH
    height = grid_height + 0.5  # and a band for the title
    fig = plt.figure(figsize=(width, height))
    fig.text(0.5, 1 - 0.25 / height, title, ha="center", va="center", fontsize=12)
    for k in range(min(len(images_u8), rows * columns)):
        row, column = divmod(k, columns)
        top, left = (row + 1) * cell_rows - side - 2, column * cell_columns + (cell_columns - side) // 2
        canvas[top:top + side, left:left + side] = images_u8[k]
        above_image = (rows - row - 1) * cell_rows + side + 3  # in image pixels from the grid's bottom
        fig.text((column + 0.5) / columns, above_image * GRID_INCH / height, titles[k], ha="center", va="bottom",
                 fontsize=8, color=colors[k])
    ax = fig.add_axes((0, 0, 1, grid_height / height))
    ax.imshow(canvas, cmap="gray", vmin=0, vmax=255, interpolation="nearest", aspect="auto")
    ax.axis("off")
    return _save(fig, path)


def bars(labels: Sequence[str], values: Sequence[float], title: str, unit: str, path) -> Path:
    """Horizontal bar chart, one bar per label."""
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.4))
    positions = np.arange(len(labels))
    ax.barh(positions, values, color=RIGHT)
    ax.set_yticks(positions, labels)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title)
    for y, value in zip(positions, values, strict=True):
        ax.text(value, y, f" {value:,.0f}", va="center", fontsize=8)
    ax.grid(True, axis="x", alpha=0.25)
    fig.tight_layout()
    return _save(fig, path)


def strip(values: Sequence[float], names: Sequence, target: float | None, title: str, path,
          target_name: str = "target") -> Path:
    """Each value as a dot (labelled with its name), their mean as a bar, and the target as a line."""
    fig, ax = plt.subplots(figsize=(7, 2.4))
    percent = 100 * np.asarray(values, dtype=np.float64)
    jitter = np.linspace(-0.15, 0.15, len(percent)) if len(percent) > 1 else np.zeros(1)
    ax.scatter(percent, jitter, color=ACCURACY_COLOR, zorder=3)
    for x, y, name in zip(percent, jitter, names, strict=True):
        ax.annotate(str(name), (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.axvline(percent.mean(), color=LOSS_COLOR, label=f"mean {figures.percent(float(np.mean(values)))}")
    if target is not None:
        ax.axvline(100 * target, color=WRONG, linestyle="--", label=f"{target_name} {figures.percent(target)}")
    ax.set_yticks([])
    ax.set_ylim(-0.5, 0.5)
    percent_axis(ax, [*percent, *([100 * target] if target is not None else [])])
    ax.set_xlabel("test accuracy (%)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, axis="x", alpha=0.25)
    fig.tight_layout()
    return _save(fig, path)


def percent_axis(ax, percents: Sequence[float]) -> None:
    """An x axis of test accuracy in percent that spans these values with room either side, at least 0.1
    points wide, ticked at whole hundredths or coarser: 10,000 test images resolve 0.01 points, so a
    tick at 95.0025 would name a figure no run can have."""
    low, high = min(percents), max(percents)
    margin = max(0.05, 0.08 * (high - low))
    ax.set_xlim(low - margin, high + margin)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=8, steps=[1, 2, 5, 10]))
    ax.ticklabel_format(axis="x", style="plain", useOffset=False)  # 95.02, not "+9.5e1" and offsets


def sweep(rows: Sequence[dict], names: Sequence[str], path) -> Path:
    """Test accuracy against each swept value: one panel per name, one dot per member."""
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        values = np.array([row[name] for row in rows], dtype=np.float64)
        ax.scatter(values, [100 * row["test_accuracy"] for row in rows], color=ACCURACY_COLOR, zorder=3)
        if (values > 0).all() and values.max() / values.min() >= 10:
            ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("test accuracy (%)")
        ax.grid(True, alpha=0.25)
    fig.suptitle("Sweep: each member's test accuracy")
    fig.tight_layout()
    return _save(fig, path)
