"""Compute entry points the model calls; a torch reference for each."""
