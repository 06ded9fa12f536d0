"""Paged KV block accounting and the prefix cache."""
