"""Broken distributed backends (issue 44): reference-tp / reference-dcp with one fault each, failed by
suites/test_distributed.py naming the rank (tests/meta/test_distributed_meta.py): a rank that raises, one that is
killed (a crash), one that hangs, TP without the output's all-reduce, DCP keeping every token on every rank."""

from __future__ import annotations

import os
import signal
import time

import torch

from mla_conformance.impl.backends.distributed import ReferenceDCP, ReferenceTP


class RaisesOnRank1(ReferenceTP):
    name = "broken-dist-raises-rank1"

    def attend(self, *args, **kw):
        if self.par.rank == 1:
            raise RuntimeError("injected failure on rank 1")
        return super().attend(*args, **kw)


class CrashesOnRank1(ReferenceTP):
    name = "broken-dist-crashes-rank1"

    def attend(self, *args, **kw):
        if self.par.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().attend(*args, **kw)


class HangsOnRank1(ReferenceTP):
    name = "broken-dist-hangs-rank1"

    def attend(self, *args, **kw):
        if self.par.rank == 1:
            time.sleep(3600)
        return super().attend(*args, **kw)


class TPWithoutAllReduce(ReferenceTP):
    """Returns its rank's partial o_proj output: the row-parallel all-reduce left out."""

    name = "broken-dist-tp-no-allreduce"

    def attend(self, *args, **kw):
        tp, self.par = self.par, type(self.par)(**{**self.par.__dict__, "tp_size": 1})
        try:
            return super().attend(*args, **kw)
        finally:
            self.par = tp


class DCPKeepsEveryToken(ReferenceDCP):
    """Its cache also stores every token on every rank (a copy kept without the ownership mask)."""

    name = "broken-dist-dcp-keeps-all"

    def new_cache(self, config, **kw):
        cache = super().new_cache(config, **kw)
        cache.every = torch.zeros(cache.kv.shape[0], cache.capacity, cache.kv.shape[-1], dtype=cache.kv.dtype)
        cache.tensors = lambda: {"kv": cache.kv, "every": cache.every}
        return cache

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        start = cache.seq_lens.clone()
        y = super().attend(weights, hidden_states, positions, cache, lengths)
        for b in range(hidden_states.shape[0]):
            n = int(cache.seq_lens[b] - start[b])
            cache.every[b, int(start[b]):int(start[b]) + n] = 0.0
        return y
