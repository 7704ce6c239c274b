"""Correctness checks over the serving path (the model runner's steps and kernel set): stage parity of one
DFlash proposal against the independent NumPy reference, the taps check, and the greedy identity gate."""
