"""The project's logger: one format for every module, set up once by `init_logger`."""

import logging
import os

logger = logging.getLogger("torchtitan_xla")


def init_logger(level: int = logging.INFO) -> None:
    """Log to stderr with a short prefix; safe to call more than once."""
    logger.setLevel(level)
    logger.propagate = False
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[titan-xla %(asctime)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    # torch_xla/absl print a GSPMD deprecation warning per compile; it is noise for users.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
