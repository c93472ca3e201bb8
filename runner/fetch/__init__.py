"""Where model files come from: the registry, Hugging Face Hub downloads, and the cache of fetched models."""
