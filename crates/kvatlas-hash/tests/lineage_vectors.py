#!/usr/bin/env python3
"""Generator of kvatlas's own `PositionalLineageHash` golden vectors.

Computes the vectors from the layout written in `docs/hashing.md` ("`PositionalLineageHash(u128)`"),
independently of the Rust code (Python 3, standard library only: the lineage hash is bit packing,
no XXH3 involved). The results are asserted by `lineage_hash_vectors` in `tests/golden.rs` and
listed in the table of `docs/hashing.md`.

    python3 crates/kvatlas-hash/tests/lineage_vectors.py            # the rows of golden.rs
    python3 crates/kvatlas-hash/tests/lineage_vectors.py --markdown # the rows of docs/hashing.md
    python3 crates/kvatlas-hash/tests/lineage_vectors.py --check    # both files hold exactly these

`--check` exits non-zero, printing what differs, unless both files contain the generated rows
verbatim (in order, as one block).
"""

import sys
from pathlib import Path

# Layout (most significant bit first):
#   bits 127..126  mode m (0..=2; 3 is reserved): the smallest mode whose position field fits
#   next P(m) bits position
#   next F(m) bits parent fragment: low F bits of the parent's sequence hash (0 at position 0)
#   low  F(m) bits current fragment: low F bits of this block's sequence hash
# At the last position of a mode (255, 65535) the current fragment keeps only the *next* mode's
# F bits (the child there can store no more of its parent).
MODES = [(8, 59), (16, 55), (24, 51)]  # (P, F); P + 2F = 126 in every mode

CURRENT = 0x0123456789ABCDEF
PARENT = 0xFEDCBA9876543210
POSITIONS = [0, 1, 255, 256, 65535, 65536, 16777215]


def mask(bits):
    return (1 << bits) - 1


def lineage_hash(current, parent, position):
    """The packed u128 and its mode; `parent` is None at position 0."""
    mode = next(m for m, (p, _) in enumerate(MODES) if position < 1 << p)
    p, f = MODES[mode]
    if position == 0:
        assert parent is None
        parent_fragment = 0
    else:
        parent_fragment = parent & mask(f)
    current_bits = f
    if position == mask(p) and mode + 1 < len(MODES):
        current_bits = MODES[mode + 1][1]
    current_fragment = current & mask(current_bits)
    value = (mode << 126) | (position << (2 * f)) | (parent_fragment << f) | current_fragment
    assert value < 1 << 128
    return value, mode


def vectors():
    for position in POSITIONS:
        parent = PARENT if position > 0 else None
        value, mode = lineage_hash(CURRENT, parent, position)
        yield position, value, mode


def rust_rows():
    return [f"        ({pos}, 0x{value:032x}, {mode})," for pos, value, mode in vectors()]


def markdown_rows():
    rows = []
    for pos, value, mode in vectors():
        label = f"{pos} (no parent)" if pos == 0 else str(pos)
        rows.append(f"| {label} | `0x{value:032x}` | {mode} |")
    return rows


def contains_block(text, rows):
    lines = text.splitlines()
    n = len(rows)
    return any(lines[i : i + n] == rows for i in range(len(lines) - n + 1))


def check():
    crate = Path(__file__).resolve().parent.parent
    files = [
        (crate / "tests" / "golden.rs", rust_rows()),
        (crate.parent.parent / "docs" / "hashing.md", markdown_rows()),
    ]
    ok = True
    for path, rows in files:
        if contains_block(path.read_text(encoding="utf-8"), rows):
            print(f"ok: {path} holds the {len(rows)} generated rows")
        else:
            ok = False
            print(f"MISMATCH: {path} does not hold these rows verbatim:", file=sys.stderr)
            print("\n".join(rows), file=sys.stderr)
    return 0 if ok else 1


def main(argv):
    if argv == []:
        print("\n".join(rust_rows()))
        return 0
    if argv == ["--markdown"]:
        print("\n".join(markdown_rows()))
        return 0
    if argv == ["--check"]:
        return check()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
