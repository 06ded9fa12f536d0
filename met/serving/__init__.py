"""Requests → engine requests: validation, chat templates, prompts, detokenization, stops."""
