"""DSSE pre-authentication encoding and envelopes, against published vectors."""

from __future__ import annotations

import base64

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, utils
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from plyx.governance import GovernanceError, make_statement, pae, sign_envelope, verify_envelope
from plyx.governance._dsse import INTOTO_PAYLOAD_TYPE, parse_statement


def test_pae_published_vector() -> None:
    # DSSE protocol.md, "Test Vectors"
    assert pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"


def test_published_ecdsa_signature_verifies_over_our_pae() -> None:
    """protocol.md's envelope was signed (ECDSA P-256, SHA-256) over the PAE; it verifies only if our PAE is byte-exact."""
    x = 46950820868899156662930047687818585632848591499744589407958293238635476079160
    y = 5640078356564379163099075877009565129882514886557779369047442380624545832820
    public = ec.EllipticCurvePublicNumbers(x, y, ec.SECP256R1()).public_key()
    raw = base64.b64decode("A3JqsQGtVsJ2O2xqrI5IcnXip5GToJ3F+FnZ+O88SjtR6rDAajabZKciJTfUiHqJPcIAriEGAHTVeCUjW2JIZA==")
    der = utils.encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
    payload = base64.b64decode("aGVsbG8gd29ybGQ=")
    public.verify(der, pae("http://example.com/HelloWorld", payload), ec.ECDSA(hashes.SHA256()))
    with pytest.raises(InvalidSignature):
        public.verify(der, pae("http://example.com/HelloWorld ", payload), ec.ECDSA(hashes.SHA256()))


def test_pae_counts_bytes_not_characters() -> None:
    assert pae("application/vnd.exämple+json", b"") == b"DSSEv1 29 application/vnd.ex\xc3\xa4mple+json 0 "


# DSSE testvectors/vectors.json: Ed25519 keys of RFC 8032 section 7.1 (TEST 1, TEST 2)
KEY_A = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(
    "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"))
KEY_B = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(
    "4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb"))
STATEMENT_B64 = "eyJfdHlwZSI6Imh0dHBzOi8vaW4tdG90by5pby9TdGF0ZW1lbnQvdjEifQ=="
SIG_A = "2WAfaHm5jluo0w+0rk8uVkluELJYWjSmU9x7EUzx+AyteDGJ4/nqyJXfmAUVFIAoQafWm7AxBZNw5M9ixNHiCA=="
SIG_B = "c1+67/aT0yqEpwx8PsVY3MLHsj9D0CZ014/Fv/QlG59P+9CobUZ7xECJ/V3USG0Ob9CiE5LjReEZUzNF2l7eBw=="


def test_rfc8032_keys() -> None:
    assert KEY_A.public_key().public_bytes_raw().hex() == \
        "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"


def test_vector_single_signature_accepted() -> None:
    env = {"payload": STATEMENT_B64, "payloadType": INTOTO_PAYLOAD_TYPE, "signatures": [{"sig": SIG_A, "keyid": "A"}]}
    assert verify_envelope(env, [KEY_A.public_key()]) == b'{"_type":"https://in-toto.io/Statement/v1"}'
    # Ed25519 is deterministic: our signer reproduces the vector's signature
    body = base64.b64decode(STATEMENT_B64)
    assert base64.b64encode(KEY_A.sign(pae(INTOTO_PAYLOAD_TYPE, body))).decode() == SIG_A


def test_vector_url_safe_base64_accepted() -> None:
    env = {"payload": "-_-_Pj8=", "payloadType": INTOTO_PAYLOAD_TYPE, "signatures": [
        {"sig": "P-_KHICeR7tI6S_YyejJTRtrXhcQyQ2LYPaL8h90KjC9qN8HU_svOQ6TuDOT1HIrsGW886DbWNWcCmX5twLrAw==",
         "keyid": "A"}]}
    assert verify_envelope(env, [KEY_A.public_key()]) == b"\xfb\xff\xbf>?"


def test_vector_payload_type_swapped_rejected() -> None:
    env = {"payload": STATEMENT_B64, "payloadType": "application/vnd.example.other+json",
           "signatures": [{"sig": SIG_A, "keyid": "A"}]}
    with pytest.raises(GovernanceError, match="signature"):
        verify_envelope(env, [KEY_A.public_key()], payload_types=[INTOTO_PAYLOAD_TYPE,
                                                                    "application/vnd.example.other+json"])


def test_vector_threshold_counts_unique_keys() -> None:
    trusted = [KEY_A.public_key(), KEY_B.public_key()]
    two = {"payload": STATEMENT_B64, "payloadType": INTOTO_PAYLOAD_TYPE,
           "signatures": [{"sig": SIG_A}, {"sig": SIG_B}]}
    assert verify_envelope(two, trusted, threshold=2)
    same_twice = {**two, "signatures": [{"sig": SIG_A, "keyid": "A"}, {"sig": SIG_A, "keyid": "A"}]}
    with pytest.raises(GovernanceError, match="1 of 2"):
        verify_envelope(same_twice, trusted, threshold=2)


def test_roundtrip_and_tamper() -> None:
    key = Ed25519PrivateKey.generate()
    statement = make_statement({"model.onnx": "ab" * 32}, "https://example.com/p", {"x": 1})
    env = sign_envelope(statement, key)
    parsed = parse_statement(verify_envelope(env, [key.public_key()]))
    assert parsed["subject"] == [{"name": "model.onnx", "digest": {"sha256": "ab" * 32}}]
    sig = bytearray(base64.b64decode(env["signatures"][0]["sig"]))
    sig[10] ^= 0x01
    bad = {**env, "signatures": [{"sig": base64.b64encode(bytes(sig)).decode()}]}
    with pytest.raises(GovernanceError, match="0 of 1"):
        verify_envelope(bad, [key.public_key()])
    with pytest.raises(GovernanceError, match="0 of 1"):
        verify_envelope(env, [Ed25519PrivateKey.generate().public_key()])
    body = bytearray(base64.b64decode(env["payload"]))
    body[5] ^= 0x01
    with pytest.raises(GovernanceError, match="0 of 1"):
        verify_envelope({**env, "payload": base64.b64encode(bytes(body)).decode()}, [key.public_key()])


@pytest.mark.parametrize("envelope", [[], {"payloadType": 1}, {"payloadType": "t", "payload": "!!"},
                                      {"payloadType": "t", "payload": "", "signatures": []}])
def test_malformed_envelopes_are_named(envelope: object) -> None:
    with pytest.raises(GovernanceError, match="envelope"):
        verify_envelope(envelope, [KEY_A.public_key()])
