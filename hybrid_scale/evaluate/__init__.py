"""The ablation evaluation: `stage.evaluate(cfg)` runs its cells (mode x task, perplexity by position, passkey);
the cells on disk, log-likelihood scoring, retrieval, the balance diagnostics and the report beside it."""
