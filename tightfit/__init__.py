"""tightfit: train and fine-tune PyTorch models on GPUs with little memory, as fast as the card allows."""

__version__ = "0.1.0"

from .errors import TightfitError  # noqa: E402
from .plan import Plan  # noqa: E402
from .units import format_bytes, parse_size  # noqa: E402

__all__ = ["Plan", "TightfitError", "format_bytes", "parse_size", "__version__"]
