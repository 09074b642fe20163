"""The console script starts without torch, and a Ctrl-C while a command imports it is one line, not a
traceback from inside torch's import (which takes seconds)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_importing_the_package_and_the_console_script_does_not_import_torch():
    code = (
        "import sys, simstream, simstream.cli.main\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert {'OnlineDataEngine', 'Field', 'SourceSpec'} <= set(dir(simstream))\n"
        "from simstream import Field, OnlineDataEngine\n"
        "assert OnlineDataEngine.__module__ == 'simstream.engine.engine' and 'torch' in sys.modules\n"
        "assert simstream.Field is Field\n"
        "assert simstream.errors.OnlineDataWorkerError.__name__ == 'OnlineDataWorkerError'\n"
        "try:\n"
        "    simstream.NoSuchName\n"
        "except AttributeError as error:\n"
        "    assert \"module 'simstream' has no attribute 'NoSuchName'\" in str(error)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_version(capsys):
    from simstream import __version__
    from simstream.cli.main import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"simstream {__version__}\n"


def test_a_ctrl_c_while_a_command_is_imported_is_one_line(monkeypatch, capsys):
    """Forced: a real Ctrl-C lands in the import only if it comes within its first seconds."""
    from simstream.cli import main as cli

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["stream", "--seconds", "1"]) == 130
    assert capsys.readouterr().err == "\nsimstream stream: interrupted\n"


@pytest.mark.parametrize("argv", [[], ["--help"]])
def test_usage_lists_every_command(capsys, argv):
    from simstream.cli.main import COMMANDS, main

    assert main(argv) == (0 if argv else 2)
    captured = capsys.readouterr()
    out = captured.out if argv else captured.err  # --help to stdout; no command is a usage error
    assert (captured.err if argv else captured.out) == ""
    assert all(f"  {name:<8} " in out for name in COMMANDS)
    assert "synthetic source or a built-in task" in out


def test_sigterm_is_handled_as_ctrl_c_and_exits_143(capsys, ctrl_c_raises):
    import signal

    from simstream.cli._report import exit_code

    cleaned, before = [], signal.getsignal(signal.SIGTERM)

    def job() -> None:
        try:
            signal.raise_signal(signal.SIGTERM)
            raise AssertionError("SIGTERM did not interrupt the job")
        finally:
            cleaned.append(True)  # what a command's finally does: stop the engine, close the recorder

    assert exit_code("simstream record", job, interrupted="interrupted; what was flushed is kept") == 143
    assert capsys.readouterr().err == "\nsimstream record: terminated (SIGTERM); what was flushed is kept\n"
    assert cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is before  # put back


def test_a_sigterm_while_a_command_is_imported_is_one_line_and_exit_143(monkeypatch, capsys, ctrl_c_raises):
    import signal

    from simstream.cli import main as cli

    def terminated(name):
        signal.raise_signal(signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt the import")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli.importlib, "import_module", terminated)
    assert cli.main(["record", "--episodes", "1"]) == 143
    assert capsys.readouterr().err == "\nsimstream record: terminated (SIGTERM)\n"
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("sigint", ["ignored", "handled"])
def test_a_sigterm_inside_nested_deferred_blocks_is_held_then_raised(sigint):
    """A SIGTERM turned into a Ctrl-C while Ctrl-C is held back (``close()`` of a runner, nested) waits
    for the blocks, then raises KeyboardInterrupt, also where SIGINT is ignored (it vanished there)."""
    import signal

    from simstream.cli._report import sigterm_as_ctrl_c
    from simstream.workers.supervisor import ctrl_c_deferred

    handler = signal.SIG_IGN if sigint == "ignored" else signal.default_int_handler
    previous = signal.signal(signal.SIGINT, handler)
    terminated, finished = [], []
    try:
        with pytest.raises(KeyboardInterrupt), sigterm_as_ctrl_c(terminated), ctrl_c_deferred():
            with ctrl_c_deferred():
                signal.raise_signal(signal.SIGTERM)
                finished.append("inner")
            finished.append("outer")
        assert finished == ["inner", "outer"] and terminated == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_value_error_is_a_bad_option_only_until_the_options_are_checked(capsys):
    from simstream.cli._report import exit_code, options_checked

    def bad_option() -> None:
        raise ValueError("Args.n must be an int >= 1, got 0")

    def failure_while_running() -> None:
        options_checked()
        raise ValueError("a producer's own error")

    assert exit_code("simstream x", bad_option) == 2
    assert capsys.readouterr().err == "simstream x: Args.n must be an int >= 1, got 0\n"
    assert exit_code("simstream x", failure_while_running) == 1
    assert capsys.readouterr().err == "\nsimstream x: ValueError: a producer's own error\n"
    assert exit_code("simstream x", bad_option) == 2  # the mark belonged to the finished command
    options_checked()  # outside a command: nothing to mark, no error
