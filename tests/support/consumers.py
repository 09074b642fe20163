"""Consumer bodies that test scripts start in processes of their own (importable, so ``spawn`` finds them)."""

from __future__ import annotations

import threading
import time


def sample_until_it_fails(engine, ready) -> None:
    """Set ``ready``, then sample (bounded) until a call raises; print the engine's state and the error.

    The owner of a script that kills itself leaves this process an orphan: its printed line is the answer.
    """
    ready.set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            engine.sample_batch(2, 2)
        except Exception as error:
            print("consumer:", engine.state.value, type(error).__name__, error, flush=True)
            return
        threading.Event().wait(0.01)
    print("consumer: still sampling after 60 s", flush=True)
