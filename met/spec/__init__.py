"""Speculative decoding: proposers draft tokens, the target verifies them in the step's flat
batch (met.engine.core), and a throughput gate decides where speculation pays."""
