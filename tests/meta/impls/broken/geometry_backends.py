"""A layer backend wrong on one geometry class only, for tests/meta/test_generated_meta.py: the independent
backend (tests/meta/impls/independent/backend.py, written without mla_conformance's reference) with one bug that the
hand-written layer scenarios never reach and the generated ragged, chunked cases do."""

from __future__ import annotations

from tests.meta.impls.independent.backend import IndependentMLA, LatentCache


class _UnguardedLastWrite(LatentCache):
    """Writes each row's last new token to slot seq_len + n - 1 without checking n: a row with no new tokens in a
    call (it finished its prefill while longer rows go on in chunks) gets its last stored token overwritten by the
    call's padding (the kv_len = 0 rows of SGLang #22291)."""

    def append(self, c, k_pe, lengths):
        for b in range(self.batch_size):
            s = int(self.seq_lens[b])
            if int(lengths[b]) == 0 and s > 0:
                self.kv[b, s - 1, :self.kv_lora_rank] = c[b, 0].to(self.kv.dtype)
                self.kv[b, s - 1, self.kv_lora_rank:] = k_pe[b, 0].to(self.kv.dtype)
        super().append(c, k_pe, lengths)


class BrokenZeroNewTokenRows(IndependentMLA):
    """Correct, but for rows with no new tokens in a chunked-prefill call (:class:`_UnguardedLastWrite`): the
    hand-written scenarios chunk only a single row (long_context) and batch rows only in one call."""

    name = "broken-zero-new-token-rows"

    def new_cache(self, config, *, batch_size, capacity, dtype, device, kv_codec="none"):
        reason = self.unsupported_reason(config, dtype=dtype, device=device, kv_codec=kv_codec)
        if reason is not None:
            raise ValueError(reason)
        return _UnguardedLastWrite(config, batch_size, capacity, dtype, device)
