"""`python -m corecap`: the command line."""

from corecap.cli import main

main()
