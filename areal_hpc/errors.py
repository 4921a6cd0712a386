"""Errors a user can cause: the CLI prints them as one line and exits with code 2."""

import difflib


class UserError(Exception):
    """Bad input from the user (a config key, a path, a value): reported without a traceback."""


def closest(word: str, candidates) -> str:
    """Return ", did you mean 'x'?" for the nearest candidate, or "" when nothing is close."""
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.5)
    return f", did you mean '{match[0]}'?" if match else ""
