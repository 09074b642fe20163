"""LeRobot feature keys <-> simstream field names.

The rule, both ways: ``observation.a.b`` <-> ``obs/a/b``, ``action`` <-> ``actions``, any other key maps
``.`` <-> ``/``. A key map (``{lerobot_key: field_name}``) overrides the rule for the keys it names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["BOOKKEEPING_KEYS", "KeyMap", "feature_to_field", "field_to_feature"]

BOOKKEEPING_KEYS = ("timestamp", "frame_index", "episode_index", "index", "task_index")
"""Per-frame columns LeRobot adds to every dataset; they are no payload field."""


def feature_to_field(key: str) -> str:
    """The field name of LeRobot feature ``key`` by the rule (``observation.state`` -> ``obs/state``)."""
    if key == "action":
        return "actions"
    if key == "observation" or key.startswith("observation."):
        return "obs" + key[len("observation") :].replace(".", "/")
    return key.replace(".", "/")


def field_to_feature(name: str) -> str:
    """The LeRobot feature key of field ``name`` by the rule (``obs/image`` -> ``observation.image``)."""
    if name == "actions":
        return "action"
    if name == "obs" or name.startswith("obs/"):
        return "observation" + name[len("obs") :].replace("/", ".")
    return name.replace("/", ".")


class KeyMap:
    """The rule plus overrides ``{lerobot_key: field_name}`` (both directions stay one-to-one).

    Examples:
        >>> KeyMap({"observation.images.top": "obs/image"}).field("observation.images.top")
        'obs/image'
        >>> KeyMap().feature("obs/state")
        'observation.state'
    """

    def __init__(self, overrides: Mapping[str, str] | None = None) -> None:
        if overrides is not None and not isinstance(overrides, Mapping):
            raise ValueError(
                "key_map must be a mapping {lerobot_key: field_name} or None, got "
                f"{type(overrides).__name__} {overrides!r:.80}"
            )
        overrides = dict(overrides or {})
        for key, name in overrides.items():
            if not isinstance(key, str) or not isinstance(name, str) or not key or not name:
                raise ValueError(
                    f"key_map entries must map a LeRobot key to a field name, got {key!r}: {name!r}"
                )
        inverse = {name: key for key, name in overrides.items()}
        if len(inverse) != len(overrides):
            raise ValueError(f"key_map must map each field name once, got {overrides!r}")
        self.overrides = overrides
        self._inverse = inverse

    @classmethod
    def parse(cls, items: Iterable[str]) -> KeyMap:
        """From command-line items ``lerobot.key=field/name``."""
        pairs = {}
        for item in items:
            key, sep, name = item.partition("=")
            if not sep or not key or not name:
                raise ValueError(f"--key-map items must read LEROBOT_KEY=FIELD_NAME, got {item!r}")
            pairs[key] = name
        return cls(pairs)

    def field(self, key: str) -> str:
        return self.overrides.get(key) or feature_to_field(key)

    def feature(self, name: str) -> str:
        return self._inverse.get(name) or field_to_feature(name)

    def check_known(self, keys: Iterable[str], where: str) -> None:
        """Raise a ValueError naming every override key that is not one of ``keys``."""
        unknown = sorted(set(self.overrides) - set(keys))
        if unknown:
            raise ValueError(
                f"key_map names LeRobot key(s) {unknown} that {where} does not have; its keys are "
                f"{sorted(keys)}"
            )

    def check_known_fields(self, names: Iterable[str], where: str) -> None:
        """Raise a ValueError naming every override field that is not one of ``names``."""
        unknown = sorted(set(self._inverse) - set(names))
        if unknown:
            raise ValueError(
                f"key_map names field(s) {unknown} that {where} does not have; its fields are {sorted(names)}"
            )
