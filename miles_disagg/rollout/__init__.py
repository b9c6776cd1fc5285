"""Rollout side: prompt data, rewards, the async group buffer, engine management and rollout functions."""
