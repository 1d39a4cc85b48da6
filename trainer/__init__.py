"""recpipe trainer: dedup-aware modules, models, the training loop and the embedding store."""
