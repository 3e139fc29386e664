"""The project's logger: one format for every module, set up once by `init_logger`."""

import logging

logger = logging.getLogger("torchtitan_xla")


def init_logger(level: int = logging.INFO) -> None:
    """Log to stderr with a short prefix; safe to call more than once."""
    logger.setLevel(level)
    logger.propagate = False
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[titan-xla %(asctime)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
