"""Models: the decoder transformer and its building blocks."""

from jaxscale.models.transformer import LanguageModel, ModelSpec

__all__ = ["LanguageModel", "ModelSpec"]
