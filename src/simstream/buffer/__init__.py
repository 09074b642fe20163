"""Shared trajectory storage, the eligibility index and the producer write protocol."""
