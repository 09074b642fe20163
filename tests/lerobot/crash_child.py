"""A recording process for the SIGKILL tests (``python -m tests.lerobot.crash_child MODE ROOT KILL_AT``).

``writer``: drives a DatasetWriter with PatternSource's episodes, flushing every 2, and SIGKILLs itself at
file-commit point ``KILL_AT`` (each committed file has two points: written but not renamed, renamed).
``engine``: an engine with a LeRobotRecorder; runs until the parent kills it.
Both print ``flushed N`` after every flush the recorder reported (``N`` episodes durable).
"""

from __future__ import annotations

import os
import signal
import sys

import av  # noqa: F401  (preloaded by the forkserver: a kill point costs no import)
import pyarrow.parquet  # noqa: F401


def _kill_at(point: int) -> None:
    from simstream.lerobot import format as fmt
    from simstream.lerobot import writer

    original = fmt.commit_file
    seen = [0]

    def commit_file(tmp, path):
        seen[0] += 1
        if seen[0] == point:
            os.kill(os.getpid(), signal.SIGKILL)  # written, not renamed
        original(tmp, path)
        seen[0] += 1
        if seen[0] == point:
            os.kill(os.getpid(), signal.SIGKILL)  # renamed

    fmt.commit_file = writer.commit_file = commit_file


def run_writer(root: str, kill_at: int, report=None) -> None:
    """``report(n)`` after every flush (default: print ``flushed n``)."""
    from simstream.lerobot.format import features_from_fields
    from simstream.lerobot.names import KeyMap
    from simstream.lerobot.writer import DatasetWriter
    from tests.lerobot.sources import PatternSpec, pattern_record

    _kill_at(kill_at)
    features = features_from_fields(PatternSpec(image_size=32).fields(), KeyMap(), video=True)
    writer = DatasetWriter(root, features, 20)
    for tag in range(writer.episodes_flushed, writer.episodes_flushed + 12):
        writer.add(pattern_record(tag))
        if writer.pending == 2:
            writer.flush()
            if report is None:
                print(f"flushed {writer.episodes_flushed}", flush=True)
            else:
                report(writer.episodes_flushed)


def run_engine(root: str) -> None:
    from simstream import OnlineDataEngine, OnlineDataEngineCfg
    from simstream.lerobot import LeRobotRecorder
    from tests.lerobot.sources import PatternSpec

    cfg = OnlineDataEngineCfg(
        source=PatternSpec(image_size=32), buffer_size=4, num_workers=1, refill_policy="manual"
    )
    engine = OnlineDataEngine(cfg)
    recorder = LeRobotRecorder(engine, root, flush_every=2, flush_interval_s=0.05)
    with recorder, engine:
        reported = -1
        while True:
            engine.request_refill()
            recorder.wait_flushed(reported + 1, timeout_s=0.5)
            recorder.check()
            if recorder.episodes_flushed != reported:
                reported = recorder.episodes_flushed
                print(f"flushed {reported}", flush=True)


if __name__ == "__main__":
    mode, root, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    run_writer(root, kill_at) if mode == "writer" else run_engine(root)
