"""Conversion of Hugging Face causal LMs and the converted-model format."""
