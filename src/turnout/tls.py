"""Trusting an https controller: the system's CAs, plus a private CA's PEM where one is given.

Workers and the CLI take `--ca-cert PATH` (the SDK `ca_cert=`, and `TURNOUT_CA_CERT` for all three), so a
controller with a certificate from a private CA (`--tls-cert`, `--tls-key`) is verified, never trusted
blindly.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from turnout.errors import InvalidInput


def tls_verify(ca_cert: Path | None) -> ssl.SSLContext | bool:
    """What httpx verifies an https controller with: True (the system's CAs), or a context that also
    trusts `ca_cert`. A file that is not PEM certificates is an InvalidInput naming `ca-cert`."""
    if ca_cert is None:
        return True
    context = ssl.create_default_context()
    try:
        context.load_verify_locations(cafile=str(ca_cert))
    except (OSError, ssl.SSLError) as exc:
        raise InvalidInput(
            f"--ca-cert: cannot load {ca_cert} as PEM certificates ({exc})", field="ca-cert"
        ) from None
    return context
