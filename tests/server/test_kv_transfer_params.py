"""The router's reading of a prefill worker's kv_transfer_params: a choice that ended on the prefill side
(its first token was a stop) has no handoff, beside choices that do."""

from __future__ import annotations

from hybridserve.server.kv_transfer_params import handles, handoff_bytes


def test_choices_that_ended_on_the_prefill_side_move_nothing() -> None:
    params = {
        "requests": [
            {"handoff": {"handle": "h0", "bytes_by_group": {"swa_kv": 100, "csa_rows": 20}}},
            {"handoff": None, "finish_reason": "stop"},
            {"handoff": {"handle": "h2", "bytes_by_group": {"swa_kv": 50}}},
        ]
    }
    assert handoff_bytes(params) == {"swa_kv": 150, "csa_rows": 20}
    assert handles(params) == ["h0", "h2"]
    assert handoff_bytes({"requests": [{"handoff": None}]}) == {}
