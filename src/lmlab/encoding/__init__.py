"""Using an encoder (BERT-style) model: fill masked tokens, embed sentences."""
