"""``simstream bench``: run the streaming benchmarks in ``benchmarks/`` (sampling, production, ...).

Each benchmark is a script ``benchmarks/<name>.py`` exposing an ``Args`` dataclass (its flags) and
``run(args) -> int``. This command parses the flags with tyro, so ``simstream bench <name> --help`` lists
them and a flag out of range is refused before anything runs, then replaces itself with the script in a
fresh interpreter (``exec``) with ``OMP_WAIT_POLICY=PASSIVE`` (OpenMP reads it once, at start-up) so that
figures match ``python benchmarks/<name>.py``. The benchmarks live in the source checkout, not in the
installed package.

Examples:
    simstream bench sampling --quick
    simstream bench production --workers 1 2
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import tyro

__all__ = ["find_benchmarks", "main"]


def _benchmarks_dir() -> Path | None:
    """``benchmarks/`` of the checkout this package was installed from (editable install), if any."""
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "benchmarks"
        if candidate.is_dir() and (parent / "pyproject.toml").is_file():
            return candidate
    return None


def find_benchmarks(directory: Path) -> dict[str, tuple[Path, type]]:
    """Benchmark scripts of ``directory`` that expose ``Args`` and ``run``: ``{name: (path, Args)}``."""
    found: dict[str, tuple[Path, type]] = {}
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))  # the scripts import their private helpers (_timing, ...)
    for path in sorted(directory.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path.name.startswith("_") or "class Args" not in text or "def run(" not in text:
            continue  # helpers and scripts without the Args/run convention are not imported at all
        module_name = f"_simstream_bench_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses resolve annotations through sys.modules
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # a broken script must not hide the others
            sys.modules.pop(module_name, None)
            print(f"simstream bench: skipping {path.name}: {type(error).__name__}: {error}", file=sys.stderr)
            continue
        if isinstance(getattr(module, "Args", None), type) and callable(getattr(module, "run", None)):
            found[path.stem] = (path, module.Args)
    return found


def main(argv: list[str]) -> int:
    """Parse ``simstream bench <name> [flags]`` and run that benchmark; returns its exit code."""
    directory = _benchmarks_dir()
    if directory is None:
        print(
            "simstream bench: no benchmarks/ directory found; the benchmarks ship with the source "
            "checkout (git clone, then `pip install -e .`).",
            file=sys.stderr,
        )
        return 2
    benchmarks = find_benchmarks(directory)
    if not benchmarks:
        print(f"simstream bench: no runnable benchmark in {directory}", file=sys.stderr)
        return 2
    commands = {name: args_type for name, (_, args_type) in benchmarks.items()}
    try:  # validates every flag (each Args checks its ranges); --help
        tyro.extras.subcommand_cli_from_dict(commands, args=argv, prog="simstream bench")
    except ValueError as error:
        print(f"simstream bench: {error}", file=sys.stderr)
        return 2
    name = argv[0]
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.stdout.flush()
    sys.stderr.flush()
    # the benchmark replaces this process: Ctrl-C and SIGTERM reach it alone, its exit code is ours, and
    # no parent is left to be killed while the benchmark's engines run on as orphans
    os.execve(sys.executable, [sys.executable, str(benchmarks[name][0]), *argv[1:]], env)
    return 1  # not reached
