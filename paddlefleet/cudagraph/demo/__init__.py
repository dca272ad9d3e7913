"""The demo and the transformer examples it runs."""
