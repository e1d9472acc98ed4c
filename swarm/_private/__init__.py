"""Helpers private to the swarm package; nothing outside swarm should import these."""
