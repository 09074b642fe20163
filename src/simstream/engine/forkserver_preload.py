"""What the forkserver imports before it serves: the producer module, then Python's Ctrl-C handler back.

A terminal's Ctrl-C reaches the whole process group. The owner handles it (its ``stop()`` ends the
producers cleanly), so it starts the forkserver with SIGINT ignored, inherited through ``exec``: an
interrupt during the forkserver's preload (torch's import, a couple of seconds) printed a
``KeyboardInterrupt`` traceback of the forkserver on top of the owner's own message. This module, imported
last, gives the forkserver Python's usual handler back before it records the handler its children start
with: the user's own forkserver processes get Ctrl-C as usual, and simstream's workers ignore SIGINT as
their first act.
"""

from __future__ import annotations

import signal

from . import producer  # noqa: F401

signal.signal(signal.SIGINT, signal.default_int_handler)
