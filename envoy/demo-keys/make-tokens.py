#!/usr/bin/env python3
"""Regenerates the DEMO signing key, the JWKS Envoy verifies with, and the demo tokens.

DEMO ONLY: the private key is committed on purpose so anyone can mint test tokens.
Never use it, or tokens signed with it, anywhere real.

Uses only the Python standard library and the openssl command.
Usage: python3 envoy/demo-keys/make-tokens.py   (rewrites the files next to this script)
"""
import base64, json, pathlib, subprocess, time

HERE = pathlib.Path(__file__).resolve().parent
ENVOY = HERE.parent
ROOT = ENVOY.parent
KEY = HERE / "demo-signing-key.pem"
ISSUER = "https://demo-issuer.edge-idempotency.invalid"
AUDIENCE = "checkout"
KID = "demo-2026"
FAR_FUTURE = 2_524_608_000  # 2050-01-01


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def sign(key: pathlib.Path, payload: dict, kid: str = KID) -> str:
    header = {"alg": "RS256", "typ": "JWT", "kid": kid}
    signing_input = f"{b64url(json.dumps(header, separators=(',', ':')).encode())}.{b64url(json.dumps(payload, separators=(',', ':')).encode())}"
    sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(key)], input=signing_input.encode(),
                         capture_output=True, check=True).stdout
    return f"{signing_input}.{b64url(sig)}"


def jwk(key: pathlib.Path) -> dict:
    modulus = subprocess.run(["openssl", "rsa", "-in", str(key), "-noout", "-modulus"], capture_output=True,
                             check=True, text=True).stdout.strip().split("=", 1)[1]
    return {"kty": "RSA", "alg": "RS256", "use": "sig", "kid": KID,
            "n": b64url(bytes.fromhex(modulus)), "e": b64url((65537).to_bytes(3, "big"))}


def claims(sub: str, exp: int = FAR_FUTURE) -> dict:
    return {"iss": ISSUER, "aud": AUDIENCE, "sub": sub, "iat": 1_764_000_000, "exp": exp}


def main() -> None:
    if not KEY.exists():
        subprocess.run(["openssl", "genrsa", "-out", str(KEY), "2048"], check=True, capture_output=True)
    (ENVOY / "demo-jwks.json").write_text(json.dumps({"keys": [jwk(KEY)]}, indent=2) + "\n")
    tokens = {"alice": sign(KEY, claims("alice")), "bob": sign(KEY, claims("bob"))}
    (ENVOY / "demo-tokens.json").write_text(json.dumps(tokens, indent=2) + "\n")

    # Tokens the tests use to prove that Envoy refuses them (401) before the filter runs.
    other = HERE / "other-key.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other), "2048"], check=True, capture_output=True)
    alice = tokens["alice"].split(".")
    tampered = claims("mallory")
    bad = {
        "expired": sign(KEY, claims("alice", exp=1_764_000_100)),
        "wrong_key": sign(other, claims("alice")),
        "wrong_issuer": sign(KEY, {**claims("alice"), "iss": "https://evil.invalid"}),
        "wrong_audience": sign(KEY, {**claims("alice"), "aud": "someone-else"}),
        # alice's signature over a payload that names mallory: the signature no longer matches.
        "tampered": f"{alice[0]}.{b64url(json.dumps(tampered, separators=(',', ':')).encode())}.{alice[2]}",
        "carol": sign(KEY, claims("carol")),
    }
    other.unlink()
    (ROOT / "tests" / "fixtures").mkdir(parents=True, exist_ok=True)
    (ROOT / "tests" / "fixtures" / "tokens.json").write_text(json.dumps(bad, indent=2) + "\n")
    print("wrote demo-jwks.json, demo-tokens.json and tests/fixtures/tokens.json")


if __name__ == "__main__":
    main()
