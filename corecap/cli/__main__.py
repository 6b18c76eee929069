"""`python -m corecap.cli`."""

from corecap.cli import main

main()
