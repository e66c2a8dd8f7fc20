"""N-gram speculative decoding for sgl."""
