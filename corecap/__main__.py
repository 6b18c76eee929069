"""`python -m corecap`: the command line."""

from corecap.cli.entry import entry

entry()
