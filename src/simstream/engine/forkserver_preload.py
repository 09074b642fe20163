"""What the forkserver imports before it serves (the producer module), and why it ignores Ctrl-C.

A terminal's Ctrl-C reaches the whole process group. The owner handles it (its ``stop()`` ends the
producers cleanly), so the owner starts the forkserver with SIGINT ignored, inherited through ``exec``: an
interrupt during the forkserver's preload (torch's import, a couple of seconds) or while a new producer
unpickles its arguments (before it can ignore SIGINT itself) printed a ``KeyboardInterrupt`` traceback on
top of the owner's own message. The processes this forkserver starts inherit the ignored SIGINT too;
every simstream process started through it ignores SIGINT anyway.
"""

from __future__ import annotations

from . import producer  # noqa: F401
