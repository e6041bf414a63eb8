"""Offline data for preference and forward-process training: pair tables and VAE-encoded images."""
