"""Reading the world: locations, checkpoints and their layouts, loading into models, Hugging Face
folders and tokenizers, data sets."""
