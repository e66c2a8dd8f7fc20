"""Draft-model speculative decoding for sgl."""
