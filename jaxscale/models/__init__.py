"""Models: the decoder transformer, its building blocks and its parallel strategy."""

from jaxscale.models.strategy import Strategy
from jaxscale.models.transformer import LanguageModel, ModelSpec, model_from_config

__all__ = ["LanguageModel", "ModelSpec", "Strategy", "model_from_config"]
