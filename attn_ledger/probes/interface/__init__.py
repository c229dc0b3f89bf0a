"""`check --protocol transformers`: a function registered in transformers' AttentionInterface."""
