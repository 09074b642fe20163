"""``simstream rl``: asynchronous PPO on a gymnasium MuJoCo task, with a progress bar and a run report.

Writes TensorBoard logs, checkpoints, ``learning_curve.png`` and ``summary.json`` to ``runs/<name>/``.
Exit codes: 0 done, 2 a bad option (named in the message; nothing is written), 3 the collector died (its
report is printed to stderr), 4 training ended but a shared resource could not be released (each error is
printed and stored in ``summary.json``), 1 any other failure, 130 interrupted (Ctrl-C), 143 terminated
(SIGTERM, as a scheduler or ``kill`` sends: handled as a Ctrl-C, so the model is saved and the report
written).
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Annotated

import tyro

from simstream._runs import FOLDER_NAME_RULE, claim_run_folder, is_folder_name
from simstream.rl.config import APPOConfig

from ._report import EXIT_TERMINATED, sigterm_as_ctrl_c

__all__ = ["EXIT_CLOSE_FAILED", "EXIT_COLLECTOR_DIED", "EXIT_TERMINATED", "RLArgs", "main"]

EXIT_COLLECTOR_DIED = 3
EXIT_CLOSE_FAILED = 4
_MODE_FLAGS = {"--sync": "sync", "--serial": "serial"}
"""Short forms of ``--mode sync`` and ``--mode serial``."""


@dataclass(frozen=True)
class RLArgs:
    """Train asynchronous PPO (V-trace + target network) while a collector process steps the envs.

    ``--env`` is short for ``--env-id``; ``--sync`` for ``--mode sync``; ``--serial`` for ``--mode serial``.
    """

    iterations: int = 100_000
    """Most updates to run."""
    max_env_frames: int | None = 1_000_000
    """Stop after the collector has stepped this many frames (None: only --iterations bounds the run)."""
    target_return: float | None = None
    """Stop once the mean return of the last stats-window episodes reaches this."""
    name: str | None = None
    """Run name; output goes to <runs-dir>/<name>/ (default: <env>-<mode>-<date>-<time>)."""
    runs_dir: str = "runs"
    """Folder that holds the runs (created when missing)."""
    resume: str | None = None
    """A checkpoint (model_<n>.pt) to continue from: model, optimiser, normaliser, target net, versions."""
    save_interval: int = 50
    """Save a checkpoint every this many updates (0: only the last one)."""
    progress: bool = True
    """Show a progress bar (env frames/s, episode return, policy lag)."""
    ppo: Annotated[APPOConfig, tyro.conf.arg(name="")] = field(default_factory=APPOConfig)
    """Algorithm and collector settings."""

    def __post_init__(self) -> None:
        for flag, value, low in (
            ("--iterations", self.iterations, 1),
            ("--save-interval", self.save_interval, 0),
        ):
            if type(value) is not int or value < low:
                raise ValueError(f"{flag} must be an int >= {low}, got {value!r}.")
        frames = self.max_env_frames
        if frames is not None and (type(frames) is not int or frames < 1):
            raise ValueError(f"--max-env-frames must be None or an int >= 1, got {frames!r}.")
        target = self.target_return
        if target is not None and not math.isfinite(target):
            raise ValueError(f"--target-return must be None or a finite number, got {target!r}.")
        name = self.name
        if name is not None and not is_folder_name(name):
            raise ValueError(f"--name must be {FOLDER_NAME_RULE}, got {name!r}.")


def main(argv: list[str]) -> int:
    """Parse ``argv`` with tyro, train, write the report; returns the exit code."""
    argv = ["--env-id" if a == "--env" else a.replace("--env=", "--env-id=", 1) for a in argv]
    modes = {_MODE_FLAGS[a] for a in argv if a in _MODE_FLAGS}
    modes |= {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--mode"}
    modes |= {a.partition("=")[2] for a in argv if a.startswith("--mode=")}
    if len(modes) > 1:
        return _bad_option(f"--sync, --serial and --mode choose different modes {sorted(modes)}; give one.")
    argv = [x for a in argv for x in (("--mode", _MODE_FLAGS[a]) if a in _MODE_FLAGS else (a,))]
    try:
        args = tyro.cli(RLArgs, args=argv, prog="simstream rl")
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except ValueError as error:  # a config field out of range
        print(f"simstream rl: {_name_the_flag(str(error))}", file=sys.stderr)
        return 2
    return run(args)


def _name_the_flag(message: str) -> str:
    """``APPOConfig.gamma must be ...`` -> ``... (--gamma)``: the option a user typed, beside the field.

    >>> _name_the_flag("RunnerConfig.hang_timeout_s must be a number > 0, got 0")
    'RunnerConfig.hang_timeout_s must be a number > 0, got 0 (option --runner.hang-timeout-s)'
    """
    match = re.match(r"(APPOConfig|RunnerConfig)\.(\w+)", message)
    if match is None:
        return message
    prefix = "--runner." if match.group(1) == "RunnerConfig" else "--"
    return f"{message} (option {prefix}{match.group(2).replace('_', '-')})"


def run(args: RLArgs) -> int:
    """Train as ``args`` say and write the run report; returns the exit code (see the module)."""
    from gymnasium.error import Error as GymnasiumError

    from simstream.rl import APPORunner, CollectorDiedError
    from simstream.rl.report import write_learning_curve, write_summary

    cfg = args.ppo
    mode = cfg.mode
    # an unnamed run's folder is claimed (created) once the options are known to be good
    name = args.name
    run_dir = None if name is None else os.path.join(args.runs_dir, name)
    # bad options end here, with exit code 2 and nothing created on disk
    if args.resume is not None and not os.path.isfile(args.resume):
        return _bad_option(f"--resume {args.resume!r} is not a checkpoint file.")
    continuing = (
        run_dir is not None
        and args.resume is not None
        and os.path.dirname(os.path.realpath(args.resume)) == os.path.realpath(run_dir)
    )
    if run_dir is not None and os.path.isdir(run_dir) and os.listdir(run_dir) and not continuing:
        return _bad_option(
            f"--name: {run_dir!r} already holds a run (its logs and checkpoints would mix with this one's); "
            "choose another --name, or --resume from a checkpoint in it to continue that run"
        )
    try:
        runner = APPORunner(cfg, resume=args.resume)
    except GymnasiumError as error:
        return _bad_option(f"--env {cfg.env_id!r} is not a gymnasium environment here: {error}")
    except ValueError as error:  # a checkpoint of another task
        return _bad_option(str(error))
    except ModuleNotFoundError as error:
        module = cfg.env_id.partition(":")[0] if ":" in cfg.env_id else None
        if module is not None and not _importable(module):
            return _bad_option(f"--env {cfg.env_id!r}: there is no module {module!r} to import")
        print(f"simstream rl: {type(error).__name__}: {error}", file=sys.stderr)
        return 1  # the env's module exists; something it imports does not
    except Exception as error:
        print(f"simstream rl: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    try:
        if name is None:
            name = claim_run_folder(args.runs_dir, f"{cfg.env_id.split(':')[-1]}-{mode}")
            run_dir = os.path.join(args.runs_dir, name)
        else:
            os.makedirs(run_dir, exist_ok=True)
    except OSError as error:
        runner.close()
        where = args.runs_dir if run_dir is None else run_dir
        return _bad_option(f"--runs-dir/--name: cannot create {where!r}: {error}")
    print(f"simstream rl: {mode} PPO on {cfg.env_id}, {cfg.num_envs} envs; writing to {run_dir}", flush=True)
    bar = _Bar(args.max_env_frames) if args.progress else None
    code = 0
    terminated: list[int] = []
    try:
        with sigterm_as_ctrl_c(terminated), runner:  # a SIGTERM during close() is a Ctrl-C too
            runner.learn(
                args.iterations,
                save_interval=args.save_interval,
                log_dir=run_dir,
                max_env_frames=args.max_env_frames,
                target_return=args.target_return,
                callback=bar.update_row if bar else None,
            )
    except CollectorDiedError as error:
        code = EXIT_COLLECTOR_DIED
        _close(bar)
        print(
            f"\nsimstream rl: the collector process died; training stopped.\n{error.report}", file=sys.stderr
        )
    except KeyboardInterrupt:
        code = EXIT_TERMINATED if terminated else 130
        _close(bar)
        print(f"\nsimstream rl: {'terminated (SIGTERM)' if terminated else 'interrupted'}", file=sys.stderr)
    except Exception as error:  # the CLI reports; the library raises
        code = 1
        _close(bar)
        print(f"\nsimstream rl: {type(error).__name__}: {error}", file=sys.stderr)
    _close(bar)
    errors = runner.last_close_report.errors if runner.last_close_report is not None else ()
    if errors:
        code = code or EXIT_CLOSE_FAILED
        listed = "\n".join(f"  - {error}" for error in errors)
        print(f"simstream rl: shared resources could not be released:\n{listed}", file=sys.stderr)
    if runner.last_run_summary is not None:
        summary = dict(runner.last_run_summary, run_dir=run_dir, close_report=repr(runner.last_close_report))
        write_summary(summary, os.path.join(run_dir, "summary.json"))
        if runner.history:
            write_learning_curve(runner.history, os.path.join(run_dir, "learning_curve.png"),
                                 f"{mode} PPO on {cfg.env_id}")  # fmt: skip
        _print_summary(summary, curve=bool(runner.history))
    return code


def _importable(module: str) -> bool:
    """False when ``module`` or a package above it does not exist (not when something it imports is
    missing: that is the module's own error, reported as such)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError as error:
        missing = error.name or ""
        return not (missing == module or module.startswith(missing + "."))


def _bad_option(message: str) -> int:
    print(f"simstream rl: {message}", file=sys.stderr)
    return 2


class _Bar:
    def __init__(self, total: int | None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="frames", unit_scale=True, dynamic_ncols=True)
        self.last_frames = 0

    def update_row(self, row: dict[str, float]) -> None:
        frames = int(row["rl/env_frames"])
        self.bar.update(frames - self.last_frames)
        self.last_frames = frames
        self.bar.set_postfix(
            fps=f"{row['rl/env_frames_per_s']:.0f}",
            ret=f"{row['rl/return']:.1f}",
            lag=f"{row['rl/policy_lag']:.1f}",
            it=int(row["rl/iteration"]),
            refresh=False,
        )


def _close(bar: _Bar | None) -> None:
    if bar is not None:
        bar.bar.close()


def _print_summary(summary: dict, curve: bool) -> None:
    fields = (
        "status", "iterations", "env_frames", "wall_time_s", "env_frames_per_s", "final_return",
        "best_return", "mean_policy_lag", "dropped_overflow", "dropped_stale", "last_checkpoint",
        "close_errors",
    )  # fmt: skip
    width = max(map(len, fields))
    print("\n".join(f"  {k:<{width}}  {summary.get(k)}" for k in fields))
    written = "learning_curve.png, summary.json" if curve else "summary.json (no update finished: no curve)"
    print(f"  report: {summary['run_dir']}/{written}, TensorBoard logs")
