"""Ed25519 signatures for records: ``RECORD.json.sig`` beside the record.

The key pair is made on first use in ``~/.met/identity/`` (``$MET_IDENTITY_DIR`` overrides):
``ed25519.pem`` (private, mode 0600) and ``ed25519.pub.pem``. A signature file is JSON with
the algorithm, the signer's public key and the signature over the record's exact bytes, so
any change to the record (even whitespace) fails verification.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

PRIVATE_NAME = "ed25519.pem"
PUBLIC_NAME = "ed25519.pub.pem"
SIG_SUFFIX = ".sig"


def identity_dir() -> Path:
    """Where the key pair lives: ``$MET_IDENTITY_DIR`` or ``~/.met/identity``."""
    env = os.environ.get("MET_IDENTITY_DIR")
    return Path(env) if env else Path.home() / ".met" / "identity"


def load_or_create_key(directory: Path | None = None) -> Ed25519PrivateKey:
    """The private key, generated (and written with mode 0600) on first use."""
    d = directory or identity_dir()
    path = d / PRIVATE_NAME
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: not an Ed25519 private key")
        return key
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    (d / PUBLIC_NAME).write_bytes(_public_pem(key.public_key()))
    return key


def _public_pem(pub: Ed25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.PEM,
                            serialization.PublicFormat.SubjectPublicKeyInfo)


def _raw(pub: Ed25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def sig_path(record: Path) -> Path:
    return record.with_name(record.name + SIG_SUFFIX)


def sign_file(record: Path, key: Ed25519PrivateKey | None = None) -> Path:
    """Sign ``record``'s bytes; returns the ``.sig`` path written beside it."""
    key = key or load_or_create_key()
    signature = key.sign(record.read_bytes())
    out = sig_path(record)
    out.write_text(json.dumps({
        "algorithm": "ed25519",
        "public_key": base64.b64encode(_raw(key.public_key())).decode(),
        "signature": base64.b64encode(signature).decode(),
        "file": record.name,
    }, indent=2) + "\n")
    return out


@dataclass(frozen=True)
class Verification:
    """The outcome of ``verify_file``: ``ok`` and why."""

    ok: bool
    reason: str


def _trusted_key(public_key: Path | None) -> Ed25519PublicKey | None:
    path = public_key or identity_dir() / PUBLIC_NAME
    if not path.exists():
        if public_key is not None:
            raise FileNotFoundError(f"--public-key: {path} does not exist")
        return None
    key = serialization.load_pem_public_key(path.read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path}: not an Ed25519 public key")
    return key


def verify_file(record: Path, public_key: Path | None = None) -> Verification:
    """Check ``record`` against its ``.sig``. The signer must be ``public_key`` (a PEM file)
    or, by default, this machine's identity; with no local identity the key inside the
    signature is used and the result says the signer is unverified."""
    sig = sig_path(record)
    if not record.exists():
        raise FileNotFoundError(f"RECORD: {record} does not exist")
    if not sig.exists():
        return Verification(False, f"no signature: {sig} does not exist")
    try:
        data = json.loads(sig.read_text())
        embedded = base64.b64decode(data["public_key"])
        signature = base64.b64decode(data["signature"])
    except (ValueError, KeyError, TypeError) as e:
        return Verification(False, f"{sig}: malformed signature file ({e})")
    if data.get("algorithm") != "ed25519":
        return Verification(False, f"{sig}: unsupported algorithm {data.get('algorithm')!r}")
    trusted = _trusted_key(public_key)
    if trusted is not None and _raw(trusted) != embedded:
        who = public_key or identity_dir() / PUBLIC_NAME
        return Verification(False, f"signed by another key than {who}")
    key = trusted or Ed25519PublicKey.from_public_bytes(embedded)
    try:
        key.verify(signature, record.read_bytes())
    except InvalidSignature:
        return Verification(False, "signature does not match: the record was changed after "
                                   "it was signed")
    signer = "a trusted key" if trusted is not None else "the key in the signature " \
        "(no local identity to check the signer against)"
    return Verification(True, f"signature valid, signed by {signer}")
