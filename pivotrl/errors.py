"""Errors that are the user's to fix: reported as one line, exit status 2, no traceback."""


class UserError(Exception):
    """A mistake in what the user asked for (a path, an address, a combination of settings)."""


class RunInterrupted(Exception):
    """The run cannot go on (a device lost with state nothing else holds); the message says how to resume it."""


class TrainingDiverged(RunInterrupted):
    """The updates stopped being finite (``pivotrl.runtime.job.diverged``): resuming would diverge again, so the
    job does not resume itself; the message says what to change."""
