"""``simstream demo``: stream expert episodes, train a behaviour-cloning policy live, evaluate, report.

Exit codes: 0 done, 2 a bad option (the message names the field and its range), 130 interrupted (the
producers are stopped first), 1 any other failure (a producer's error, printed with its type).
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Parse the flags of :class:`~simstream.bc.DemoConfig` and run the demo; returns the exit code."""
    import tyro

    from simstream.bc import DemoConfig, run_demo

    try:
        # --quick changes the defaults; flags given next to it still win.
        default = DemoConfig().with_quick() if "--quick" in argv else DemoConfig()
        cfg = tyro.cli(DemoConfig, args=argv, default=default, prog="simstream demo")
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except ValueError as error:
        print(f"simstream demo: {error}", file=sys.stderr)
        return 2
    try:
        summary = run_demo(cfg)
    except KeyboardInterrupt:
        print("\nsimstream demo: interrupted; the producers are stopped", file=sys.stderr)
        return 130
    except Exception as error:  # the CLI reports; the library raises
        print(f"\nsimstream demo: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    final = summary["final_eval"]
    print(
        f"\nclosed-loop success on {summary['task']}: {final['success_rate']:.0%} "
        f"({final['successes']}/{final['episodes']} seeded episodes) after {summary['steps_done']} steps; "
        f"{summary['stream']['successful_episodes']} expert episodes streamed; "
        f"{summary['total_time_s']:.0f} s in all\nreport: {summary['report']}",
        flush=True,
    )
    return 0
