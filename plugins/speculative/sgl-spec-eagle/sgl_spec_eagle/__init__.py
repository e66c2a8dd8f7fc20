"""EAGLE and EAGLE-3 speculative decoding for sgl."""
