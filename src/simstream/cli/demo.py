"""``simstream demo``: stream expert episodes, train a behaviour-cloning policy live, evaluate, report.

Exit codes: 0 done, 2 a bad option (the message names the field and its range), 130 interrupted (the
producers are stopped first), 1 any other failure (a producer's error, printed with its type).
"""

from __future__ import annotations

from ._report import exit_code

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Parse the flags of :class:`~simstream.bc.DemoConfig` and run the demo; returns the exit code."""
    import tyro

    from simstream.bc import DemoConfig

    parsed: list[DemoConfig] = []

    def parse() -> None:
        # --vision and --quick change the defaults (in that order); flags given next to them still win.
        default = DemoConfig().with_vision() if "--vision" in argv else DemoConfig()
        default = default.with_quick() if "--quick" in argv else default
        parsed.append(tyro.cli(DemoConfig, args=argv, default=default, prog="simstream demo"))

    def parse_and_check() -> None:
        parse()
        if parsed:  # not --help: the engine's settings and /dev/shm, before a run folder exists
            from simstream.bc.demo import check_demo_setup

            check_demo_setup(parsed[0])

    code = exit_code("simstream demo", parse_and_check)
    if code or not parsed:  # a bad option, or --help
        return code
    # from here on a ValueError is a failure of the run, not a bad option
    interrupted = "interrupted; the producers are stopped"
    return exit_code("simstream demo", lambda: _run(parsed[0]), bad_options=(), interrupted=interrupted)


def _run(cfg) -> None:
    from simstream.bc import run_demo

    summary = run_demo(cfg)
    final = summary["final_eval"]
    print(
        f"\nclosed-loop success on {summary['task']}: {final['success_rate']:.0%} "
        f"({final['successes']}/{final['episodes']} seeded episodes) after {summary['steps_done']} steps; "
        f"{summary['stream']['successful_episodes']} expert episodes streamed; "
        f"{summary['total_time_s']:.0f} s in all\nreport: {summary['report']}",
        flush=True,
    )
