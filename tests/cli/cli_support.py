"""The CLI contract for bad input, shared by the CLI tests: one line `ERROR: ... HINT: ...`, the exit code, no traceback."""
from memlens.cli.main import main


def one_line(capsys, *argv, code=2):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == code, err
    assert err.count("\n") == 1 and err.startswith("ERROR: ") and "  HINT: " in err, err
    assert "Traceback" not in err and "internal error" not in err
    return err.strip()
