"""Strata: fast, lossless LLM decoding with DFlash block drafters."""

__version__ = "0.1.0"
