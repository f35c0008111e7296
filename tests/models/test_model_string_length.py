"""A --model string longer than any name or path is refused in one line (it reached the file system as OSError)."""
import pytest

from memlens.cli.main import main
from memlens.core.errors import ModelSourceError
from memlens.models.source import resolve


def test_ten_thousand_characters_are_refused():
    with pytest.raises(ModelSourceError) as e:
        resolve("a" * 10_000)
    assert e.value.message == ("--model is 10,000 characters ('aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'...): longer than "
                               "any model name, Hugging Face id or path (at most 4096)")


@pytest.mark.parametrize("model", ["a" * 300, "a" * 300 + ":factory"])
def test_a_path_component_the_file_system_refuses_is_one_line(model):
    with pytest.raises(ModelSourceError) as e:
        resolve(model)
    assert e.value.message == f"--model {'a' * 60!r}...: not a usable path (File name too long)"


def test_the_cli_says_it_in_one_line_and_exits_2(capsys):
    assert main(["estimate", "--model", "a" * 10_000]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ERROR: --model is 10,000 characters") and len(err.splitlines()) == 1
