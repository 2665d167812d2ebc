"""Command-line flags as kvtier's tools take them: a parser whose errors are one line and
exit status 2, and int types whose messages name the value (the CLI and the bench
scripts share them)."""
from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: {message}\n")
        sys.exit(2)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (the message names the value; argparse adds the flag)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} must be at least {low}")
    return value
