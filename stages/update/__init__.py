"""update stage."""
