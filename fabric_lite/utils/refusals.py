"""`NotSupportedError`, `refused` and `refused_class`, from their old path: they live in `fabric_lite.refusals`
(the lowest layer, so that every layer may refuse a name)."""

from fabric_lite.refusals import NotSupportedError, message, refused, refused_class

__all__ = ["NotSupportedError", "refused", "refused_class", "message"]
