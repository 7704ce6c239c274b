"""Host work in the middle of a step that a CUDA graph captures.

A mixture-of-experts target whose expert cache left experts in host memory must read each sparse layer's
routing on the host, run those experts on the CPU and hand their outputs back before the layer can
finish. The model runner still captures such a step: a module calls on_host(fill) where the host's work
belongs, and while the runner captures it (splitting) the step's graph ends there, fill is kept to run
at that point of every replay, and a new graph begins. A replay is then graph, fill, graph, fill, ...,
graph: one launch per segment instead of one per kernel. fill may only read tensors that the captured
work wrote and write tensors that later work reads, all allocated before it is handed over: their
addresses are the graphs'."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

_capture = threading.local()  # .split: the capture running on this thread, if any


def on_host(fill: Callable[[], None]) -> None:
    """fill() now, or, while this thread captures a step in segments, at this point of each replay."""
    split = getattr(_capture, "split", None)
    if split is None:
        fill()
    else:
        split(fill)


@contextmanager
def splitting(split: Callable[[Callable[[], None]], None]):
    """Within it, on_host on this thread hands its fill to split (the runner's capture) instead of running it."""
    before = getattr(_capture, "split", None)
    _capture.split = split
    try:
        yield
    finally:
        _capture.split = before
