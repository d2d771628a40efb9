"""Looking at models: correctness proofs on a user's own configuration."""
