"""Interoperability with other frameworks' weights: Hugging Face (Llama, Mistral, Qwen2, GPT-2) import and export.

Needs the `hf` extra (`pip install 'jaxscale[hf]'`): safetensors, and transformers on the
Hugging Face side.
"""

from jaxscale.interop.hf import load_hf_params, model_config_from_hf, save_hf

__all__ = ["load_hf_params", "model_config_from_hf", "save_hf"]
