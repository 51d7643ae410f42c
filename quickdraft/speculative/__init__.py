"""Speculative decoding: drafters, verification and tree building."""
