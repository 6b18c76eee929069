"""The project's error type (a leaf module: everything may import it)."""


class CorecapError(Exception):
    """An error the user can cause and fix; the CLI prints it as one line and exits non-zero."""
