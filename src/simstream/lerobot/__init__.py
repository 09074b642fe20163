"""LeRobot datasets (format v3.0) both ways: record the live stream, replay a dataset as a source.

* :class:`LeRobotRecorder` copies every episode the producers publish into a dataset, beside the sampler;
* :class:`LeRobotSpec` is a ``SourceSpec`` streaming a dataset's episodes into the engine.

Names map as ``observation.a.b`` <-> ``obs/a/b``, ``action`` <-> ``actions``, otherwise ``.`` <-> ``/``
(:class:`KeyMap` overrides). pyarrow and PyAV (the ``lerobot`` extra) are imported only when a dataset is
read or written; lerobot itself is never needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .names import KeyMap, feature_to_field, field_to_feature

if TYPE_CHECKING:
    from .format import LeRobotFormatError
    from .recorder import LeRobotRecorder
    from .spec import LeRobotSpec
    from .writer import DatasetInUseError

__all__ = [
    "DatasetInUseError",
    "KeyMap",
    "LeRobotFormatError",
    "LeRobotRecorder",
    "LeRobotSpec",
    "feature_to_field",
    "field_to_feature",
]

_LAZY = {
    "DatasetInUseError": "writer",
    "LeRobotRecorder": "recorder",
    "LeRobotSpec": "spec",
    "LeRobotFormatError": "format",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
