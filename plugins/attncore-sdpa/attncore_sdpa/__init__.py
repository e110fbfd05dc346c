"""attncore backend "sdpa": dense prefill on ``torch.nn.functional.scaled_dot_product_attention``."""

from .backend import SdpaBackend

__all__ = ["SdpaBackend"]
__version__ = "0.1.0"
