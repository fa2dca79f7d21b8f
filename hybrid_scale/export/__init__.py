"""The merged export: `stage.export(cfg)` writes a self-contained Hugging Face directory."""
