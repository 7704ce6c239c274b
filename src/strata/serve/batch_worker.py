"""The engine thread of a batching server (--max-num-seqs N > 1): a request joins the running batch at the next
decode step and leaves it when done, or within a step once its client goes away or the server cuts it."""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from ..engine.batch import BatchEngine, Sequence
from ..engine.decode import GenerationResult

log = logging.getLogger("strata.serve")


class BatchWorker:
    def __init__(self, batch: BatchEngine, server):
        """server: the app's Server (its metrics and running / waiting gauges)."""
        self.batch, self.server = batch, server
        self.inbox: queue.Queue = queue.Queue()
        self.live: dict[Sequence, tuple] = {}  # sequence -> (job, future)
        threading.Thread(target=self.loop, name="strata-batch", daemon=True).start()

    def submit(self, job) -> Future:
        fut: Future = Future()
        self.inbox.put((job, fut))
        return fut

    def take(self) -> None:
        """New requests into the batch; blocks while there is nothing to decode."""
        block = not self.batch.busy
        while True:
            try:
                job, fut = self.inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            seq = Sequence(job.prompt_ids, job.max_tokens, job.params, frozenset(job.stop_ids),
                           on_tokens=job.on_tokens)
            self.live[seq] = (job, fut)
            if job.cancel.is_set():
                seq.finish_reason = "abort"
                self.finish(seq)
            else:
                self.batch.add(seq)

    def finish(self, seq: Sequence) -> None:
        job, fut = self.live.pop(seq)
        limit = None
        if seq.finish_reason == "length":
            limit = "max_new_tokens" if len(seq.output_ids) >= seq.max_new_tokens else "context"
        job.result = GenerationResult(seq.prompt_ids, list(seq.output_ids), seq.finish_reason, limit)
        self.server.metrics.record_generation(job.result, job.finish_reason)
        job.finish()
        fut.set_result(job)

    def loop(self) -> None:
        while True:
            self.take()
            for seq, (job, _) in list(self.live.items()):
                if job.cancel.is_set() and seq.finish_reason is None:
                    self.batch.abort(seq)
                    self.finish(seq)
            try:
                done = self.batch.step()
            except Exception as e:  # noqa: BLE001 - every request in the batch fails with it, the server goes on
                log.error("batch step failed: %s: %s", type(e).__name__, e)
                for seq, (job, fut) in list(self.live.items()):
                    self.batch.abort(seq)
                    del self.live[seq]
                    job.finish()
                    fut.set_exception(e)
                continue
            self.server.metrics.batch_size.observe(len(self.batch.running) + len(done))
            self.server.set_running(len(self.batch.running))
            for seq in done:
                self.finish(seq)
