"""EngineCore (the step loop) and the offline LLM front."""
