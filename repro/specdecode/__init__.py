"""Speculative decoding end to end: a Llama-style target, an EAGLE-style draft, a V2-style capture runner."""
