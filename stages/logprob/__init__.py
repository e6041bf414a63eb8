"""logprob stage."""
