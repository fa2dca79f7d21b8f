"""Stage 1, attention transfer: `stage.distill(cfg)` is its loop, layer by layer; the teacher's buffers, the
layer's identity and markers, the per-step training and the objectives beside it."""
