"""What a training run leaves in ``runs/<name>/``: a learning-curve PNG and a JSON summary."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

__all__ = ["write_learning_curve", "write_summary"]


def write_learning_curve(history: Sequence[dict[str, float]], path: str, title: str) -> str:
    """Plot mean episode return against env frames and against wall-clock seconds; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in history if not math.isnan(r.get("rl/return", math.nan))]
    frames = [r["rl/env_frames"] for r in rows]
    seconds = [r["rl/wall_s"] for r in rows]
    returns = [r["rl/return"] for r in rows]
    fig, (by_frames, by_time) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    by_frames.plot(frames, returns, color="tab:blue")
    by_frames.set_xlabel("environment frames")
    by_time.plot(seconds, returns, color="tab:orange")
    by_time.set_xlabel("wall-clock seconds")
    for axis in (by_frames, by_time):
        axis.set_ylabel("mean episode return")
        axis.grid(alpha=0.3)
    fig.suptitle(title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_summary(summary: dict, path: str) -> str:
    """Write ``summary`` as indented JSON (NaN becomes ``null``); returns ``path``."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(clean, f, indent=2, sort_keys=True)
        f.write("\n")
    return path
