#!/usr/bin/env python3
"""Compares two folders of `scripts/golden-outputs.py`, listing the files that differ once
the intended changes named by --ignore are taken out (JSON keys dropped before comparing).

    scripts/golden-diff.py BEFORE AFTER [--ignore KEY]...
"""

import json
import pathlib
import sys


def body(path):
    """The file's exit line and its JSON value (a text line before it dropped), or its text."""
    text = path.read_text(errors="replace")
    if text.startswith("status "):
        head, _, rest = text.partition("\n")
        return head, rest
    head, _, rest = text.partition("--- stdout\n")
    brace = min([i for i in (rest.find("{"), rest.find("[")) if i >= 0], default=-1)
    return head, rest[brace:] if brace >= 0 else rest


def drop(value, keys):
    if isinstance(value, dict):
        return {k: drop(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [drop(v, keys) for v in value]
    return value


def main():
    before, after = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    keys = {sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--ignore"}
    differ = 0
    for a in sorted(before.rglob("*")):
        if not a.is_file():
            continue
        b = after / a.relative_to(before)
        if not b.exists():
            print(f"missing: {b}")
            differ += 1
            continue
        if a.read_bytes() == b.read_bytes():
            continue
        if a.suffix == ".html":
            # A page's field `KEY` is a line of its own: dropped as the JSON key is.
            def lines(p):
                return [
                    line
                    for line in p.read_text(errors="replace").splitlines()
                    if not any(f'data-field="{k}"' in line for k in keys)
                ]

            if lines(a) != lines(b):
                print(f"differs: {a.relative_to(before)}")
                differ += 1
            continue
        (ha, ta), (hb, tb) = body(a), body(b)
        try:
            same = ha == hb and drop(json.loads(ta), keys) == drop(json.loads(tb), keys)
        except ValueError:
            same = False
        if not same:
            print(f"differs: {a.relative_to(before)}")
            differ += 1
    print(f"{differ} files differ beyond the ignored keys")


if __name__ == "__main__":
    main()
