"""Exact and semantic response cache (Redis, or in-process when no Redis is configured)."""
