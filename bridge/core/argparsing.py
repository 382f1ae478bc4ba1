"""What every command line of the bridge's own (`tes-bridge`, `python -m bridge.job`) shares.

The TES client (`bridge.client`) keeps a copy of its own: it imports nothing of the bridge, so
that it works, and could ship, apart from it.
"""

from __future__ import annotations

import argparse


def no_abbreviations(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Turn off argparse's prefix matching in `parser` and every subparser below it: an
    abbreviation silently picks another option (`--time 5` was `--timeout 5`)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                no_abbreviations(sub)
    return parser
