"""Command-line entry points (``simstream <command>``); parsing only, the work lives in the library."""
