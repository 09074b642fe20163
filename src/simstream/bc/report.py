"""The demo's report: PNG plots of one run and a ``report.md`` that shows them with the numbers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["PLOTS", "STRIPS", "write_plots", "write_report", "write_strips"]

PLOTS = ("overview.png", "loss.png", "success.png", "throughput.png", "generations.png")
"""Files :func:`write_plots` creates in the run folder."""
STRIPS = {"success": "strip_success.png", "failure": "strip_failure.png"}
"""Files :func:`write_strips` creates (vision runs), when the final evaluation had such an episode."""
_STRIP_FRAMES = 8


def write_strips(run_dir: Path, strips: dict[str, tuple[int, list[Any]]]) -> list[Path]:
    """A PNG strip of what the vision policy saw (its cameras stacked) in a successful and a failed episode.

    Args:
        run_dir: The run folder.
        strips: ``EvalResult.strips``: outcome -> ``(seed, frames [S, S * cameras, 3])``.
    """
    import imageio.v3 as iio
    import numpy as np

    paths = []
    for outcome, (_, frames) in sorted(strips.items()):
        if not frames:
            continue
        picks = np.linspace(0, len(frames) - 1, min(_STRIP_FRAMES, len(frames))).round().astype(int)
        # cameras side by side in each frame -> one column per time step, cameras stacked vertically
        columns = []
        for index in picks:
            frame = frames[index]
            size = frame.shape[0]
            views = [frame[:, k : k + size] for k in range(0, frame.shape[1], size)]
            columns.append(np.concatenate(views, axis=0))
        gap = np.full((columns[0].shape[0], 2, 3), 255, dtype=np.uint8)
        strip = np.concatenate([part for column in columns for part in (column, gap)][:-1], axis=1)
        strip = strip.repeat(2, axis=0).repeat(2, axis=1)  # 64 px frames are small on screen
        paths.append(run_dir / STRIPS[outcome])
        iio.imwrite(paths[-1], strip)
    return paths


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _draw_loss(ax, log: dict[str, Any]) -> None:
    steps = [item[0] for item in log["loss"]]
    losses = [item[2] for item in log["loss"]]
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.6, label="per step")
    ax.plot(steps, _smooth(losses, max(1, len(losses) // 100)), color="tab:blue", label="smoothed")
    ax.set_yscale("log")
    ax.set(xlabel="gradient step", ylabel="masked chunk MSE (normalised)", title="Training loss")
    ax.legend(loc="upper right")


def _draw_success(ax, log: dict[str, Any], final: dict[str, Any]) -> None:
    evals = log["evals"]
    if evals:
        ax.plot([e["step"] for e in evals], [100 * e["success_rate"] for e in evals], "o-", label="check")
    ax.plot([log["steps_done"]], [100 * final["success_rate"]], "*", markersize=14, color="tab:red",
            label=f"final: {final['successes']}/{final['episodes']}")  # fmt: skip
    ax.axhline(80, color="grey", linestyle=":", linewidth=1, label="target 80%")
    ax.set_ylim(-3, 103)
    ax.set(xlabel="gradient step", ylabel="closed-loop success (%)", title="Success rate over training")
    ax.legend(loc="lower right")


def _draw_throughput(ax, log: dict[str, Any]) -> None:
    stream = log["stream"]
    times = [s["time_s"] for s in stream]
    ax.plot(times, [s["samples_per_s"] for s in stream], color="tab:green", label="contexts sampled / s")
    ax.set(xlabel="training time (s)", ylabel="contexts / s", title="Streaming throughput")
    twin = ax.twinx()
    twin.plot(
        times, [s["fresh_episodes_per_s"] for s in stream], color="tab:orange", label="fresh episodes / s"
    )
    twin.set_ylabel("fresh episodes / s")
    lines = ax.get_lines() + twin.get_lines()
    ax.set_ylim(bottom=0)
    twin.set_ylim(bottom=0)
    ax.legend(lines, [line.get_label() for line in lines], loc="lower left", framealpha=0.9)


def _draw_generations(ax, log: dict[str, Any]) -> None:
    stream = log["stream"]
    times = [s["time_s"] for s in stream]
    ax.step(times, [s["completed_generation"] for s in stream], where="post", color="tab:purple",
            label="completed generation")  # fmt: skip
    ax.set(xlabel="training time (s)", ylabel="buffer generation", title="Buffer generations")
    twin = ax.twinx()
    twin.plot(
        times, [s["successful_episodes"] for s in stream], color="tab:brown", label="episodes published"
    )
    twin.set_ylabel("episodes published (total)")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="lower right", framealpha=0.9)


def write_plots(run_dir: Path, log: dict[str, Any], final: dict[str, Any]) -> list[Path]:
    """Write :data:`PLOTS` into ``run_dir``: four single plots and a 2x2 overview; returns their paths.

    Args:
        run_dir: The run folder.
        log: ``TrainingLog.as_dict()``.
        final: ``{"success_rate", "successes", "episodes"}`` of the final evaluation.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI backend
    import matplotlib.pyplot as plt

    draws = {
        "loss.png": lambda ax: _draw_loss(ax, log),
        "success.png": lambda ax: _draw_success(ax, log, final),
        "throughput.png": lambda ax: _draw_throughput(ax, log),
        "generations.png": lambda ax: _draw_generations(ax, log),
    }
    paths = []
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for ax, draw in zip(axes.flat, draws.values()):
        draw(ax)
    fig.suptitle(
        f"simstream demo: behaviour cloning from a live stream — {final['success_rate']:.0%} success"
    )
    fig.tight_layout()
    paths.append(run_dir / "overview.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    for name, draw in draws.items():
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        draw(ax)
        fig.tight_layout()
        paths.append(run_dir / name)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def _vision_rows(summary: dict[str, Any]) -> list[str]:
    bare = summary["stream"].get("bare_source")
    if bare is None:
        return []
    stream, workers = summary["stream"], summary["config"]["num_workers"]
    return [
        f"| fresh episodes/s with rendering (stream, during training) vs the bare source | "
        f"{stream['mean_fresh_episodes_per_s']:.2f}/s vs {bare['episodes_per_s']:.2f}/s for one producer "
        f"alone (x {workers} = {stream['bare_episodes_per_s_all_workers']:.2f}/s) |",
        f"| rendering | {bare['render_ms_per_frame']:.1f} ms per frame (all cameras), "
        f"{bare['render_share']:.0%} of a producer's time |",
    ]


def _strip_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for outcome, file in STRIPS.items():
        if any(path.endswith(file) for path in summary.get("strips", [])):
            lines += [f"What the policy saw in a {outcome} (cameras stacked, left to right in time):", "",
                      f"![{outcome}]({file})", ""]  # fmt: skip
    return lines


def _thread_rows(summary: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """How many steps used the producers' cores too (``idle_threads``); nothing when it was off."""
    if not cfg.get("idle_threads"):
        return []
    steps = summary.get("idle_thread_steps", 0)
    return [
        f"| trainer threads: while producing / between generations | {cfg['num_threads']} / "
        f"{cfg['idle_threads']} ({steps} of {summary['steps_done']} steps between generations) |"
    ]


def _arithmetic(dtype: str) -> str:
    return "float32" if dtype == "float32" else f"{dtype} autocast (weights, optimiser and loss in float32)"


def write_report(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write ``run_dir/report.md`` from the run's summary (the same dict as ``summary.json``)."""
    final, stream, cfg = summary["final_eval"], summary["stream"], summary["config"]
    lines = [
        f"# simstream demo — `{summary['name']}`",
        "",
        f"Behaviour cloning on **{summary['task']}**, trained from episodes that {cfg['num_workers']} "
        + (
            f"producer processes replayed from the LeRobot dataset `{cfg['dataset']}`."
            if cfg.get("dataset")
            else "producer processes streamed live from MuJoCo with a scripted expert (no dataset on disk)."
        )
        + (
            f" The policy sees only the {' and '.join(cfg['cameras'])} cameras ({cfg['image_size']} px), "
            "the robot's proprioception and the instruction: no object poses."
            if summary.get("vision")
            else ""
        )
        + (
            " An auxiliary head learned to predict the cubes' positions from the camera features "
            f"(weight {cfg['object_aux_weight']:g}); the true positions were a training target like the "
            "actions, never an input"
            + (
                ", and the policy read the head's own estimate, made from pixels."
                if cfg.get("object_input")
                else "."
            )
            if summary.get("vision") and cfg.get("object_aux_weight")
            else ""
        )
        + (
            " Evaluation (the checks during training and the final one) and the checkpoint used a moving "
            f"average of the weights (decay {cfg['ema_decay']:g})."
            if cfg.get("ema_decay")
            else ""
        )
        + (
            " The predicted gripper command was executed fully open above "
            f"{cfg['gripper_threshold']:g} and closed below, as the expert commands it."
            if cfg.get("gripper_threshold") is not None
            else ""
        )
        + (
            " The producers executed the expert's joint targets plus Gaussian noise "
            f"({cfg['action_noise']:g} rad) and recorded its own command (DART), so the stream shows "
            "corrections and retried grasps."
            if summary.get("vision") and cfg.get("action_noise")
            else ""
        ),
        "",
        "| result | value |",
        "|---|---|",
        f"| closed-loop success (final, seeded) | **{final['success_rate']:.0%}** "
        f"({final['successes']}/{final['episodes']} episodes) |",
        f"| mean episode length (steps at 20 Hz) | {final['mean_length']:.1f} |",
        f"| gradient steps | {summary['steps_done']} of {cfg['steps']}"
        + (" (stopped by the time limit)" if summary["stopped_early"] else "")
        + " |",
        f"| final loss (smoothed) | {summary['final_loss']:.4f} |",
        f"| training arithmetic | {_arithmetic(summary.get('training_dtype', 'float32'))} |",
        *_thread_rows(summary, cfg),
        f"| wall time: total / training / final eval | {summary['total_time_s']:.0f} s / "
        f"{summary['train_time_s']:.0f} s / {summary['eval_time_s']:.0f} s |",
        f"| first generation ready after | {summary['startup_time_s']:.1f} s |",
        f"| expert episodes published during the run | {stream['successful_episodes']} |",
        f"| buffer generations completed | {stream['completed_generation']} |",
        "| contexts sampled: in all (normalisation statistics and prefetch included) / by training steps | "
        f"{stream['sampled_chunks']} / {stream.get('trained_contexts', 'n/a')} "
        f"({stream['mean_samples_per_s']:.0f}/s during training; fresh episodes "
        f"{stream['mean_fresh_episodes_per_s']:.1f}/s) |",
        f"| share of each training step spent waiting for a batch | {summary['batch_wait_share']:.1%} "
        "(target: under 10%) |",
        *_vision_rows(summary),
        f"| machine | {summary['machine']} |",
        "",
        "![overview](overview.png)",
        "",
        *_strip_lines(summary),
        "## Plots",
        "",
        "- [loss.png](loss.png): masked chunk loss per step",
        "- [success.png](success.png): closed-loop success at checks during training "
        f"({cfg['eval_episodes_during']} episodes each) and the final evaluation",
        "- [throughput.png](throughput.png): contexts sampled per second and fresh episodes per second",
        "- [generations.png](generations.png): buffer generations and episodes published over time",
        "",
        "## Reproduce",
        "",
        "```bash",
        f"simstream eval {summary['checkpoint']} --episodes {final['episodes']}   # same seeds, "
        + (
            "same result"
            if cfg.get("device", "cpu") == "cpu"
            else f"on the CPU (the run evaluated on {cfg['device']}: a few episodes may differ)"
        ),
        f"simstream eval {summary['checkpoint']} --episodes 4 --video rollouts.gif",
        f"tensorboard --logdir {summary['tensorboard']}",
        "```",
        "",
        "## Settings",
        "",
        "| setting | value |",
        "|---|---|",
        *[f"| `{key}` | `{value}` |" for key, value in cfg.items()],
        "",
    ]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path
