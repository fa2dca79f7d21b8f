"""Stage 2, LoRA fine-tuning of the converted model: `stage.finetune(cfg)` is its loop; its checkpoints on disk
beside it."""
