"""Model loading helpers (processors) shared by the worker and the scripts."""
