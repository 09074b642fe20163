"""``simstream`` console script: dispatch ``simstream <command> [args]`` to ``simstream.cli.<command>``.

Each command module exposes ``main(argv: list[str]) -> int`` and parses its own flags with tyro, so
``simstream <command> --help`` lists that command's options with their docstrings.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["COMMANDS", "main"]

COMMANDS: dict[str, str] = {
    "demo": "stream expert episodes, train a behaviour-cloning policy live, evaluate it, write a report",
    "eval": "re-evaluate a demo checkpoint in simulation (optionally save a GIF/MP4)",
    "inspect": "show a task's episodes, segments, instructions and camera frames",
    "stream": "start an engine (synthetic source or a built-in task) and print sampling throughput",
    "rl": "asynchronous PPO on a gymnasium MuJoCo task",
    "bench": "run the streaming benchmarks",
    "record": "record a task's expert episodes into a LeRobot v3.0 dataset",
}


def _usage() -> str:
    lines = ["usage: simstream <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, text in COMMANDS.items()]
    lines += ["", "Run `simstream <command> --help` for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)  # no command: a usage error
        return 0 if argv else 2
    if argv[0] == "--version":
        from simstream import __version__

        print(f"simstream {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"simstream: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from ._report import EXIT_INTERRUPTED, EXIT_TERMINATED, sigterm_as_ctrl_c

    terminated: list[int] = []
    try:  # each command reports a Ctrl-C or SIGTERM in its work; these land in its imports (torch: seconds)
        with sigterm_as_ctrl_c(terminated):
            module = importlib.import_module(f"simstream.cli.{command}")
            return int(module.main(rest) or 0)
    except KeyboardInterrupt:
        print(
            f"\nsimstream {command}: {'terminated (SIGTERM)' if terminated else 'interrupted'}",
            file=sys.stderr,
        )
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
