"""Broken backends of padded batches (suites/test_layer_padding.py): the reference absorbed backend with one thing
wrong about rows with ``lengths = 0`` (idle sequences in a running batch) or about multi-token steps with right
padding (speculative verify). tests/meta/test_kill_matrix.py names the test each must fail and what its message says.
"""

from __future__ import annotations

import torch

from mla_conformance.impl.backends.reference import ReferenceAbsorbed
from mla_conformance.model import reference as ref


class IdleRowDecodes(ReferenceAbsorbed):
    """A decode call (S = 1) appends a token to every row, lengths 0 or not: a decode kernel that assumes every
    row of the batch decodes (an idle row's seq_lens advances, its padding token is stored)."""

    name = "broken-idle-row-decodes"

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        if lengths is not None and hidden_states.shape[1] == 1:
            lengths = torch.ones_like(lengths)
        return super().attend(weights, hidden_states, positions, cache, lengths)


class IdleRowWritesSlot(ReferenceAbsorbed):
    """Writes every row's first new token at slot seq_lens[b], lengths 0 or not (a cache writer indexed by row, not
    by the valid tokens); seq_lens and the attention stay right, so only the cache's bytes show it."""

    name = "broken-idle-row-writes-slot"

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        out = super().attend(weights, hidden_states, positions, cache, lengths)
        if lengths is not None:
            _, _, c, k_pe = ref.project(weights, hidden_states, positions)
            for b in range(cache.batch_size):
                s = int(cache.seq_lens[b])
                if int(lengths[b]) == 0 and s < cache.capacity:
                    cache._buffers["kv_latent"][b, s] = c[b, 0].to(cache._buffers["kv_latent"].dtype)
                    cache._buffers["k_pe"][b, s] = k_pe[b, 0].to(cache._buffers["k_pe"].dtype)
        return out


class IdleRowsCompacted(ReferenceAbsorbed):
    """Drops idle rows from the batch and writes the active rows' outputs back to the first rows in order (the
    scatter back forgets the row ids): every row after an idle one gets its successor's output."""

    name = "broken-idle-rows-compacted"

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        out = super().attend(weights, hidden_states, positions, cache, lengths)
        if lengths is None:
            return out
        active = lengths.to(out.device) > 0
        packed = torch.zeros_like(out)
        packed[:int(active.sum())] = out[active]
        return packed


class VerifyStepSameOutput(ReferenceAbsorbed):
    """A multi-token step over a filled cache (S > 1 after the prefill: speculative verify) gives every query
    position of a row the output of its last valid position (ROCm aiter #2720: every position the same output)."""

    name = "broken-verify-step-same-output"

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        filled = bool((cache.seq_lens > 0).all())
        out = super().attend(weights, hidden_states, positions, cache, lengths)
        S = hidden_states.shape[1]
        if not filled or S == 1 or lengths is None:
            return out
        last = (lengths.to(out.device) - 1).clamp(min=0)
        return out[torch.arange(out.shape[0], device=out.device), last][:, None].expand_as(out).clone()


class VerifyPaddingAppended(ReferenceAbsorbed):
    """A multi-token step over a filled cache appends all S tokens of every row: the right padding of a row with
    fewer draft tokens is stored, and seq_lens advanced, as if it were tokens."""

    name = "broken-verify-padding-appended"

    def attend(self, weights, hidden_states, positions, cache, lengths=None):
        if lengths is not None and bool((cache.seq_lens > 0).all()) and hidden_states.shape[1] > 1:
            lengths = torch.full_like(lengths, hidden_states.shape[1])
        return super().attend(weights, hidden_states, positions, cache, lengths)
