"""Speculative decoding: drafters' common interface, the verifier and the decode loop."""
