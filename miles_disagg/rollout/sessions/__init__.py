"""Agentic rollout through a session endpoint (miles' TITO session server): token-exact multi-turn trajectories."""
