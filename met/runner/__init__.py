"""Turns a scheduled step into tensors, runs the model, returns logits."""
