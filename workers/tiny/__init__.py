"""Bundled tiny shapes VLM: synthetic task, tokenizer, training helpers."""
