"""Models: the decoder transformer, its building blocks and its parallel strategy."""

from jaxscale.models.language_model import LanguageModel, model_from_config
from jaxscale.models.spec import ModelSpec
from jaxscale.models.strategy import Strategy

__all__ = ["LanguageModel", "ModelSpec", "Strategy", "model_from_config"]
