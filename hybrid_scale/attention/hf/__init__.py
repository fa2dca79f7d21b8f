"""The Hugging Face integration an export carries: the decode cache (cache.py), generation's hooks (generation.py),
the export's model and config classes (modeling_hybrid_scale.py, configuration_hybrid_scale.py), the architectures
(architectures.py)."""
