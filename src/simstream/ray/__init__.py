"""Producers as Ray actors on other machines, feeding the trainer's shared buffer (``docs/scale-out.md``).

Importing this package never imports ``ray``: :class:`RayBackend` is plain configuration, and the engine
imports the ingest path (:mod:`simstream.ray.ingest`) only when it starts producers with this backend.
"""

from .backend import RayBackend, RayProducerError

__all__ = ["RayBackend", "RayProducerError"]
