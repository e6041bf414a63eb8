"""sample stage."""
