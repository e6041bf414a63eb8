"""advantage stage."""
