"""Loading models: GGUF files, Hugging Face folders, zoo names and hub ids."""
