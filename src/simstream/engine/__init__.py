"""The online data engine: lifecycle, wiring and the public sampling API."""
