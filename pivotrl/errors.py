"""Errors that are the user's to fix: reported as one line, exit status 2, no traceback."""


class UserError(Exception):
    """A mistake in what the user asked for (a path, an address, a combination of settings)."""
