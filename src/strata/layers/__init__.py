"""Shared building blocks: the reference ops, the kernel strategy, rotary tables and modules."""
