"""Embedding tables on the worker side: the sparse modules in a user's model and their wire calls."""
