"""The one logger of the package. Library code logs here and never prints."""

import logging

logger = logging.getLogger("pivotrl")


def setup_logging(level: int = logging.INFO) -> None:
    """Send pivotrl's log records to stderr once (idempotent)."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
