"""One bridge module per Hugging Face ``architectures`` string (see ``models/registry.py``)."""
