"""``simstream demo``: stream expert episodes, train a behaviour-cloning policy live, evaluate, report.

Exit codes: 0 done, 2 a bad option (the message names the field and its range), 130 interrupted (the
producers are stopped first), 1 any other failure (a producer's error, printed with its type).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._report import exit_code

if TYPE_CHECKING:
    from simstream.bc import DemoConfig

__all__ = ["main", "parse_demo_args"]


def main(argv: list[str]) -> int:
    """Parse the flags of :class:`~simstream.bc.DemoConfig` and run the demo; returns the exit code."""
    parsed: list[DemoConfig] = []

    def parse_and_check() -> None:
        parsed.append(parse_demo_args(argv))
        if parsed:  # not --help: the engine's settings and /dev/shm, before a run folder exists
            from simstream.bc.demo import check_demo_setup

            check_demo_setup(parsed[0])

    code = exit_code("simstream demo", parse_and_check)
    if code or not parsed:  # a bad option, or --help
        return code
    # from here on a ValueError is a failure of the run, not a bad option
    interrupted = "interrupted; the producers are stopped"
    return exit_code("simstream demo", lambda: _run(parsed[0]), bad_options=(), interrupted=interrupted)


def parse_demo_args(argv: list[str]) -> DemoConfig:
    """The demo's config from its flags: ``--vision`` and ``--quick`` change the defaults (in that order),
    and flags given next to them still win."""
    import tyro

    from simstream.bc import DemoConfig

    default = DemoConfig().with_vision() if _switch(argv, "vision") else DemoConfig()
    default = default.with_quick() if _switch(argv, "quick") else default
    return tyro.cli(DemoConfig, args=argv, default=default, prog="simstream demo")


def _switch(argv: list[str], name: str) -> bool:
    """The value of the switch ``--name`` / ``--no-name`` as the parser reads it: the last one given wins
    (``--vision --no-vision`` is a state run, with the state run's defaults)."""
    value = False
    for arg in argv:
        if arg == f"--{name}":
            value = True
        elif arg == f"--no-{name}":
            value = False
    return value


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
