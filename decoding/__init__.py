"""Speculative decoding engine: drafters, verification, the step loop and the async facade."""
