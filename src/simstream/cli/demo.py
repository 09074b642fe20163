"""``simstream demo``: the main job (placeholder until the behaviour-cloning demo lands: live streaming)."""

from __future__ import annotations

from .stream import StreamArgs, run_stream


def main(argv: list[str]) -> int:
    import tyro

    run_stream(tyro.cli(StreamArgs, args=argv, prog="simstream demo"))
    return 0
