"""Lengths that vary: the micro-batch shapes a data loader hands the model, from the samples' token counts.

"OOM at step N" is usually the longest sample (or the fullest packed row) arriving. From the token count of
each sample, the micro-batch size, the truncation length (``max_length``, ``--seq-len``) and how batches are
formed, :func:`batches` lists the (rows, tokens) of every step in file order and :func:`worst_any_order` the
largest shape any order of the same samples can give:

- no packing: TRL's ``DataCollatorForLanguageModeling`` (and transformers' ``DataCollatorForLanguageModeling``
  / ``DataCollatorWithPadding``) pad each batch to its longest sample, after truncation at ``max_length``:
  (B, min(longest in the batch, max_length)). With ``padding_free`` (no packing) the collator concatenates the
  batch into one row: (1, sum of the truncated lengths).
- ``packing="bfd"`` (TRL's default strategy, ``trl/data_utils.py`` ``_pack_bfd``): empty samples dropped,
  each truncated at ``max_length`` (the overflow is discarded, not split: "bfd_split" splits), sorted by
  length descending (stable), then best fit: each goes into the open row with the least room that holds it
  (the first such row opened), else a new row. ``pack_dataset`` runs through ``Dataset.map(batched=True)``,
  so rows are packed within each chunk of 1000 samples (datasets' default ``batch_size``). TRL turns on
  ``padding_free`` for bfd: a batch of B packed rows reaches the model as ONE row of their summed tokens with
  ``position_ids``.
- ``packing="wrapped"`` (``_pack_wrapped``): each chunk's tokens concatenated and cut every ``max_length``
  tokens (the chunk's last row shorter); batches padded to their longest row, as without packing.

The Trainer's sampler shuffles (``RandomSampler``): file order is what a sequential sampler gives, and
:func:`worst_any_order` is the bound over every order.

>>> [(b.rows, b.tokens) for b in batches([3, 9, 4, 2, 2], batch_size=2, max_length=8)]
[(2, 8), (2, 4), (1, 2)]
>>> pack_bfd([7, 5, 4, 3, 1], 8)
[[0, 4], [1, 3], [2]]
"""
from __future__ import annotations

import json
from bisect import bisect_left, insort
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .errors import SpecError

PACKINGS = (None, "bfd", "wrapped")
MAP_BATCH_SIZE = 1000   # datasets.Dataset.map(batched=True)'s default batch_size: pack_dataset packs per chunk of it


@dataclass(frozen=True)
class Lengths:
    """Token counts, one per sample; ``ordered`` False for a histogram (no file order to speak of)."""

    values: tuple[int, ...]
    ordered: bool = True
    source: str = "lengths"

    def __len__(self) -> int:
        return len(self.values)


@dataclass(frozen=True)
class Batch:
    """One micro-batch as the model gets it: ``rows`` x ``tokens`` (padded), from ``samples`` (0-based indices)."""

    step: int                          # 1-based, in file order
    rows: int                          # rows of input_ids the model sees (1 when padding-free)
    tokens: int                        # tokens per row (the padded length; the summed length when padding-free)
    samples: tuple[int, ...] = field(default=(), repr=False)
    longest: int = 0                   # the longest sample in it, before truncation

    @property
    def size(self) -> int:
        return self.rows * self.tokens

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rows": self.rows, "tokens": self.tokens, "longest_sample": self.longest}


# ---------- reading ----------
def read_lengths(path: str | Path) -> Lengths:
    """Token counts from a file: one whole number per line, a JSON list, or a JSON histogram {length: count}."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"lengths file {p} does not exist" if not p.exists() else f"lengths {p} is not a file",
                        hint="give --lengths a file of token counts, one per line")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError):
        raise SpecError(f"cannot read lengths file {p} as text", hint="one token count per line, a JSON list or a JSON {length: count}") from None
    return parse_lengths(text, source=str(p))


def parse_lengths(text: str, source: str = "lengths") -> Lengths:
    """:func:`read_lengths` on the text of a file.

    >>> parse_lengths("3\\n 5\\n\\n2").values, parse_lengths("[4, 1]").values, parse_lengths('{"7": 2, "3": 1}')
    ((3, 5, 2), (4, 1), Lengths(values=(3, 7, 7), ordered=False, source='lengths'))
    """
    stripped = text.strip()
    if not stripped:
        raise SpecError(f"{source} is empty", hint="one token count per line, a JSON list or a JSON {length: count}")
    if stripped[0] in "[{":
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise SpecError(f"{source} is not valid JSON ({e.msg} at line {e.lineno})", hint="a JSON list [512, 87, ...] or {\"512\": 3, ...}") from None
        if isinstance(data, dict):
            return _histogram(data, source)
        return Lengths(tuple(_count(v, f"{source} item {i + 1}") for i, v in enumerate(data)) or _empty(source), True, source)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(_count(line.strip(), f"{source} line {n}"))
    return Lengths(tuple(out) or _empty(source), True, source)


def _histogram(data: dict, source: str) -> Lengths:
    out: list[int] = []
    for k in sorted(data, key=lambda k: _count(k, f"{source} key {k!r}")):
        n = _count(data[k], f"{source} count of {k!r}")
        out.extend([_count(k, f"{source} key {k!r}")] * n)
    return Lengths(tuple(out) or _empty(source), False, source)


def _empty(source: str):
    raise SpecError(f"{source} has no lengths", hint="one token count per line, a JSON list or a JSON {length: count}")


def _count(v: Any, where: str) -> int:
    """A whole number >= 0 (a token count), from JSON or a line of text."""
    if isinstance(v, str):
        t = v.strip()
        v = int(t) if t.isdigit() or (t[:1] == "-" and t[1:].isdigit()) else v
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(f"{where}: {v!r} is not a whole number of tokens", hint="token counts are whole numbers, e.g. 512")
    if v < 0:
        raise SpecError(f"{where}: {v} is negative", hint="token counts are >= 0")
    return v


def lengths_of(dataset: Iterable, column: str = "input_ids") -> list[int]:
    """The token count of each sample of ``dataset``: a ``datasets.Dataset`` (its ``column``), or any iterable of
    token lists or of mappings with ``column``.

    >>> lengths_of([[1, 2, 3], {"input_ids": [5]}, []])
    [3, 1, 0]
    """
    cols = getattr(dataset, "column_names", None)
    if cols is not None:           # a datasets.Dataset: read the one column, not every row's dict
        if column not in cols:
            raise SpecError(f"the dataset has no column {column!r} (columns: {', '.join(cols)})", hint="tokenize it first, or pass column=")
        dataset = dataset[column]
    out = []
    for i, row in enumerate(dataset):
        if isinstance(row, dict):
            if column not in row:
                raise SpecError(f"sample {i} has no {column!r}", hint="tokenize it first, or pass column=")
            row = row[column]
        try:
            out.append(len(row))
        except TypeError:
            raise SpecError(f"sample {i} is a {type(row).__name__}, not a list of tokens", hint="pass token lists or tokenized rows") from None
    return out


# ---------- packing (trl/data_utils.py) ----------
def pack_bfd(lengths: list[int] | tuple[int, ...], max_length: int) -> list[list[int]]:
    """TRL's ``_pack_bfd`` (truncate) on one chunk: the rows, each the sample indices in the order packed."""
    items = sorted(((min(n, max_length), i) for i, n in enumerate(lengths) if n > 0), key=lambda t: -t[0])   # stable
    rows: list[list[int]] = []
    by_room: dict[int, deque] = defaultdict(deque)   # room left -> rows with that room, first come first served
    rooms: list[int] = []                            # the rooms some open row has, ascending (TRL's segment tree)
    for n, i in items:
        k = bisect_left(rooms, n)        # best fit: the least room that holds n
        if k == len(rooms):
            r = len(rows)
            rows.append([])
            left = max_length
        else:
            left = rooms[k]
            r = by_room[left].popleft()
            if not by_room[left]:
                del rooms[k]
        rows[r].append(i)
        left -= n
        if left > 0:
            if not by_room[left]:
                insort(rooms, left)
            by_room[left].append(r)
    return rows


def pack_wrapped(lengths: list[int] | tuple[int, ...], max_length: int) -> list[int]:
    """TRL's ``_pack_wrapped`` on one chunk: the token count of each row."""
    total = sum(lengths)
    return [min(max_length, total - s) for s in range(0, total, max_length)]


def _chunks(n: int, size: int = MAP_BATCH_SIZE):
    return [range(s, min(n, s + size)) for s in range(0, n, size)]


def packed_rows(lengths: tuple[int, ...], max_length: int, packing: str) -> list[tuple[int, tuple[int, ...], int]]:
    """(tokens, samples, longest sample) of each packed row, chunk after chunk as ``pack_dataset`` writes them."""
    rows = []
    for ch in _chunks(len(lengths)):
        part = [lengths[i] for i in ch]
        if packing == "bfd":
            for row in pack_bfd(part, max_length):
                idx = tuple(ch[j] for j in row)
                rows.append((sum(min(lengths[i], max_length) for i in idx), idx, max(lengths[i] for i in idx)))
        else:
            rows.extend((n, (), 0) for n in pack_wrapped(part, max_length))   # a wrapped row cuts samples anywhere
    return rows


# ---------- batches ----------
def _check(batch_size: int, max_length: int, packing: str | None) -> None:
    for name, v in (("batch size", batch_size), ("max_length", max_length)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError(f"{name} must be a whole number >= 1, got {v!r}", hint="e.g. --batch-size 4 --seq-len 2048")
    if packing not in PACKINGS:
        raise SpecError(f"packing {packing!r} is not one of bfd, wrapped", hint="TRL's packing_strategy: bfd (default) or wrapped")


def batches(lengths, batch_size: int, max_length: int, packing: str | None = None, padding_free: bool = False) -> list[Batch]:
    """Every micro-batch in file order (a sequential sampler; the last one may be short, as with drop_last False).
    ``padding_free`` is implied by bfd packing, as TRL's SFTTrainer sets it."""
    lengths = tuple(lengths.values if isinstance(lengths, Lengths) else lengths)
    _check(batch_size, max_length, packing)
    padding_free = padding_free or packing == "bfd"
    if packing is None:
        units = [(min(n, max_length), (i,), n) for i, n in enumerate(lengths)]
    else:
        units = packed_rows(lengths, max_length, packing)
    out = []
    for s in range(0, len(units), batch_size):
        part = units[s:s + batch_size]
        longest = max(u[2] for u in part)
        samples = tuple(i for u in part for i in u[1])
        if padding_free:
            out.append(Batch(len(out) + 1, 1, sum(u[0] for u in part), samples, longest))
        else:
            out.append(Batch(len(out) + 1, len(part), max(u[0] for u in part), samples, longest))
    out = [b for b in out if b.tokens > 0]
    if not out:
        raise SpecError("every sample is empty (0 tokens)", hint="give the token counts of the tokenized samples")
    return out


def worst(bs: list[Batch]) -> Batch:
    """The batch with the most tokens the model sees (rows x tokens), the first such in file order."""
    return max(bs, key=lambda b: (b.size, b.tokens, -b.step))


def worst_any_order(lengths, batch_size: int, max_length: int, packing: str | None = None, padding_free: bool = False) -> Batch:
    """The largest shape any sample order gives (step 0: no step of its own): the longest sample with B-1 others
    (B, min(longest, max_length)); padding-free, the B longest samples (or, packed, the B fullest rows) in one row.
    bfd rows are the packing of the file as given (SFTTrainer packs before its sampler shuffles)."""
    lengths = tuple(lengths.values if isinstance(lengths, Lengths) else lengths)
    _check(batch_size, max_length, packing)
    padding_free = padding_free or packing == "bfd"
    if packing is None:
        units = sorted(((min(n, max_length), n) for n in lengths), reverse=True)
    else:
        units = sorted(((t, n) for t, _, n in packed_rows(lengths, max_length, packing)), reverse=True)
    top = units[:batch_size]
    if padding_free:
        return Batch(0, 1, sum(t for t, _ in top), (), max(n for _, n in top))
    return Batch(0, len(top), top[0][0], (), max(n for _, n in top))


def spec_changes(b: Batch) -> dict[str, int]:
    """The spec fields that make the estimator run shape ``b``: batch_size and seq_len (padding-free: 1 row of
    the summed tokens, the values the SFT step of the trl work consumes)."""
    return {"batch_size": b.rows, "seq_len": b.tokens}


def flags_worst_case(batch_size: int, max_length: int, packing: str | None = None, padding_free: bool = False) -> Batch:
    """Without lengths: every sample at max_length (packed rows full): (B, max_length), or padding-free
    (1, B x max_length)."""
    _check(batch_size, max_length, packing)
    if padding_free or packing == "bfd":
        return Batch(0, 1, batch_size * max_length, (), max_length)
    return Batch(0, batch_size, max_length, (), max_length)
