"""Tests of the repository as a whole: the floors, the names, the docs, import names, the wheel."""
