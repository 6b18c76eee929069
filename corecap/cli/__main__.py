"""`python -m corecap.cli`."""

from corecap.cli.entry import entry

entry()
