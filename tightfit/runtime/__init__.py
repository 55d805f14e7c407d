"""The training loop and its guards."""
