"""DFlash block drafters: the artifact contract, converter, runtime and NumPy reference."""
