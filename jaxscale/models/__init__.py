"""Models: the decoder transformer and its building blocks."""

from jaxscale.models.transformer import LanguageModel, ModelSpec, model_from_config

__all__ = ["LanguageModel", "ModelSpec", "model_from_config"]
