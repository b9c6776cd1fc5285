"""A ``train_async`` command line refused before anything starts: exit 2, one line, no traceback."""

from __future__ import annotations

from miles_disagg.launcher import main


def refused(capsys, argv: list[str], *expected: str) -> str:
    """``train_async argv`` through the entry point: exit 2, nothing on stdout, one line on stderr
    holding every ``expected`` text; that line."""
    code = main("train_async", argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == "" and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for text in expected:
        assert text in err, err
    return err
