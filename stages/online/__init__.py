"""online stage."""
