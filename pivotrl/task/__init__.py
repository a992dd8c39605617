"""Tasks: problems read from data files (``data``), the bundled arithmetic task, and the answer checkers that
measure accuracy (``checkers``)."""
