"""Typed hook payloads: frozen structs, a dict form for older plugins, errors that name the field."""

from __future__ import annotations

import msgspec
import pytest
from plyx.specs.errors import ConfigError
from plyx.specs.payloads import (
    CheckpointPayload,
    ExportPayload,
    KernelChoice,
    Techniques,
    checkpoint_payload,
    export_payload,
    payload_dict,
)


def test_structs_are_frozen_and_round_trip_through_their_dict_form():
    t = Techniques(precision="bf16", kernels=(KernelChoice(op="rmsnorm", implementation="triton", dtype="bfloat16"),))
    payload = CheckpointPayload(run_id="r", seeds={"torch": 2**63 + 11}, outputs={"checkpoint": "/c"}, techniques=t)
    with pytest.raises(AttributeError):
        payload.run_id = "x"  # type: ignore[misc]
    as_dict = payload_dict(payload)
    assert as_dict["techniques"]["kernels"][0] == {"op": "rmsnorm", "implementation": "triton", "distribution": "",
                                                   "version": "", "device": "", "dtype": "bfloat16"}
    assert checkpoint_payload(as_dict) == payload and checkpoint_payload(payload) is payload
    assert payload_dict(None) == {} and payload_dict({"a": 1}) == {"a": 1}


def test_a_dict_that_does_not_fit_names_the_field():
    with pytest.raises(ConfigError, match=r"metadata\.techniques\.kernels\[0\]"):
        checkpoint_payload({"techniques": {"kernels": [{"op": "rmsnorm"}]}})  # no implementation
    with pytest.raises(ConfigError, match="unknown field `seedz`"):
        checkpoint_payload({"seedz": {"torch": 1}})
    with pytest.raises(ConfigError, match=r"metadata\.techniques\.parallelism"):
        checkpoint_payload({"techniques": {"parallelism": {"dp": "two"}}})


def test_export_payload_keeps_card_fields_apart():
    payload = export_payload({"name": "toy", "artifacts": ["/x/model.onnx"], "license": "MIT", "format": "onnx"})
    assert payload.name == "toy" and payload.card == {"license": "MIT", "format": "onnx"}
    assert export_payload(payload) is payload
    assert msgspec.json.decode(msgspec.json.encode(payload), type=ExportPayload) == payload
