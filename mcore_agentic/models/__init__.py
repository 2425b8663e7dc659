"""HF <-> Megatron bridges per architecture, offline tokenizer builder and tiny-model factory."""
