"""The engine: decode loop, model runner, drafters' interface, verification, sampling, statistics."""
