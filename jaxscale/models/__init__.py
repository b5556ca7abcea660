"""Models: the decoder transformer, its building blocks and its parallel strategy."""

from jaxscale.models.spec import ModelSpec
from jaxscale.models.strategy import Strategy
from jaxscale.models.transformer import LanguageModel, model_from_config

__all__ = ["LanguageModel", "ModelSpec", "Strategy", "model_from_config"]
