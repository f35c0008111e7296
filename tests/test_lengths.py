"""memlens.core.lengths: reading token counts, the micro-batch shapes a loader gives, TRL's packing."""
import json
import random

import pytest

from memlens.core.errors import SpecError
from memlens.core.lengths import (
    Lengths,
    batches,
    flags_worst_case,
    lengths_of,
    pack_bfd,
    pack_wrapped,
    packed_rows,
    parse_lengths,
    read_lengths,
    spec_changes,
    worst,
    worst_any_order,
)


def shapes(bs):
    return [(b.rows, b.tokens) for b in bs]


def test_padded_to_the_longest_in_each_batch_truncated_at_max_length():
    # batches [5, 12 -> 10], [3, 4], [9]: each padded to its longest, the last one short
    bs = batches([5, 12, 3, 4, 9], batch_size=2, max_length=10)
    assert shapes(bs) == [(2, 10), (2, 4), (1, 9)]
    assert [b.samples for b in bs] == [(0, 1), (2, 3), (4,)]
    assert [b.longest for b in bs] == [12, 4, 9]
    w = worst(bs)
    assert (w.step, w.rows, w.tokens, w.longest) == (1, 2, 10, 12)


def test_worst_step_is_the_first_of_the_largest_in_file_order():
    bs = batches([1, 2, 7, 1, 3, 7], batch_size=2, max_length=100)
    assert shapes(bs) == [(2, 2), (2, 7), (2, 7)]
    assert worst(bs).step == 2


def test_worst_any_order_puts_the_longest_sample_in_a_full_batch():
    # file order: the longest (9) sits alone in the short last batch: (1, 9); any order: (2, 9)
    w = worst(batches([2, 3, 9], 2, 50))
    assert (w.step, w.rows, w.tokens) == (2, 1, 9)
    a = worst_any_order([2, 3, 9], 2, 50)
    assert (a.rows, a.tokens, a.longest) == (2, 9, 9)
    assert (worst_any_order([2, 3, 90], 2, 50).tokens) == 50


def test_padding_free_without_packing_is_one_row_of_the_summed_truncated_lengths():
    bs = batches([5, 12, 3, 4, 9], batch_size=2, max_length=10, padding_free=True)
    assert shapes(bs) == [(1, 15), (1, 7), (1, 9)]
    a = worst_any_order([5, 12, 3, 4, 9], 2, 10, padding_free=True)
    assert (a.rows, a.tokens) == (1, 19)          # 10 (12 truncated) + 9


def test_bfd_packs_as_trl_by_hand():
    # sorted descending: 7 (new row, 1 left), 5 (no room: new row, 3 left), 4 (new row, 4 left),
    # 3 -> the least room that holds it: the row with 3 left (full), 1 -> the row with 1 left (full)
    assert pack_bfd([7, 5, 4, 3, 1], 8) == [[0, 4], [1, 3], [2]]
    assert [t for t, _, _ in packed_rows((7, 5, 4, 3, 1), 8, "bfd")] == [8, 8, 4]
    # bfd truncates (does not split) a sample longer than max_length, and drops empty ones
    assert [t for t, _, _ in packed_rows((11, 0, 2), 8, "bfd")] == [8, 2]
    # ties in room go to the row that got that room first (TRL's deque): rows 0 and 1 both have 2 left; 2 goes to row 0
    assert pack_bfd([6, 6, 2], 8) == [[0, 2], [1]]


def test_bfd_batches_are_one_padding_free_row():
    bs = batches([7, 5, 4, 3, 1], batch_size=2, max_length=8, packing="bfd")
    assert shapes(bs) == [(1, 16), (1, 4)]
    assert bs[0].samples == (0, 4, 1, 3)
    assert spec_changes(bs[0]) == {"batch_size": 1, "seq_len": 16}


def test_wrapped_cuts_every_max_length_tokens_and_pads_batches():
    assert pack_wrapped([7, 5, 4, 3, 1], 8) == [8, 8, 4]
    assert shapes(batches([7, 5, 4, 3, 1], 2, 8, packing="wrapped")) == [(2, 8), (1, 4)]


def test_packing_is_per_map_chunk_of_1000_samples():
    # 1001 samples of 3 tokens, max_length 9: the first 1000 -> 333 rows of 9 and one of 3; the 1001st alone in its
    # own chunk (packed all at once it would join that 3: a row of 6)
    rows = packed_rows(tuple([3] * 1001), 9, "bfd")
    assert [t for t, _, _ in rows][-3:] == [9, 3, 3] and len(rows) == 335


def test_bfd_and_wrapped_match_trl_pack_dataset():
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import pack_dataset

    rng = random.Random(1)
    L = [rng.choice([0, 1, 2, 5, 17, 60, 200, 333]) for _ in range(1300)]
    ds = datasets.Dataset.from_dict({"input_ids": [list(range(n)) for n in L]})
    for strategy in ("bfd", "wrapped"):
        theirs = [len(r) for r in pack_dataset(ds, 128, strategy)["input_ids"]]
        assert theirs == [t for t, _, _ in packed_rows(tuple(L), 128, strategy)]
    theirs = pack_dataset(ds, 128, "bfd")["seq_lengths"]
    assert theirs == [[min(L[i], 128) for i in s] for _, s, _ in packed_rows(tuple(L), 128, "bfd")]


def test_flags_worst_case():
    assert (flags_worst_case(4, 1024).rows, flags_worst_case(4, 1024).tokens) == (4, 1024)
    assert (flags_worst_case(4, 1024, "bfd").rows, flags_worst_case(4, 1024, "bfd").tokens) == (1, 4096)


def test_file_formats(tmp_path):
    (tmp_path / "a.txt").write_text("12\n# a comment\n\n 7 \n3\n")
    (tmp_path / "b.json").write_text("[12, 7, 3]")
    (tmp_path / "c.json").write_text(json.dumps({"12": 1, "3": 2}))
    assert read_lengths(tmp_path / "a.txt") == Lengths((12, 7, 3), True, str(tmp_path / "a.txt"))
    assert read_lengths(tmp_path / "b.json").values == (12, 7, 3)
    h = read_lengths(tmp_path / "c.json")
    assert (h.values, h.ordered) == ((3, 3, 12), False)


@pytest.mark.parametrize("text,message", [
    ("12\nabc\n", "f line 2: 'abc' is not a whole number of tokens"),
    ("12\n-4\n", "f line 2: -4 is negative"),
    ("[1, 2.5]", "f item 2: 2.5 is not a whole number of tokens"),
    ('{"8": -1}', "f count of '8': -1 is negative"),
    ('{"x": 1}', "f key 'x': 'x' is not a whole number of tokens"),
    ("  \n", "f is empty"),
    ("[]", "f has no lengths"),
    ("[1, 2", "f is not valid JSON (Expecting ',' delimiter at line 1)"),
])
def test_bad_files_are_one_line_errors(text, message):
    with pytest.raises(SpecError) as e:
        parse_lengths(text, source="f")
    assert e.value.message == message


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        read_lengths(tmp_path / "nope.txt")


def test_all_empty_samples_are_refused():
    with pytest.raises(SpecError, match="every sample is empty"):
        batches([0, 0], 2, 8)


def test_lengths_of_a_dataset_and_of_token_lists():
    assert lengths_of([[1, 2, 3], {"input_ids": [5]}, []]) == [3, 1, 0]
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4, 5, 6]], "text": ["a", "b"]})
    assert lengths_of(ds) == [2, 4]
    with pytest.raises(SpecError, match="no column 'labels'"):
        lengths_of(ds, column="labels")
    import memlens

    assert memlens.lengths_of([[1], [1, 2]]) == [1, 2]
