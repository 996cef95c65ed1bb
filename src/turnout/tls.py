"""Trusting an https controller, and the HTTP clients that do: the system's CAs, plus a private CA's PEM.

Workers and the CLI take `--ca-cert PATH` (the SDK `ca_cert=`, and `TURNOUT_CA_CERT` for all three), so a
controller with a certificate from a private CA (`--tls-cert`, `--tls-key`) is verified, never trusted
blindly. `async_client` makes the httpx client the SDK and the worker use (over `transport.py`), and remembers its TLS context,
so a file download can stream over a connection of its own with the same trust (`files.download`).
"""

from __future__ import annotations

import re
import ssl
import weakref
from pathlib import Path
from typing import Any

import httpx

from turnout.errors import InvalidInput
from turnout.transport import lean_transport

TOKEN_TEXT = re.compile(r"[\x21-\x7e]+")  # what a token may hold: it goes in a header line as it is
_contexts: weakref.WeakKeyDictionary[httpx.AsyncClient, ssl.SSLContext] = weakref.WeakKeyDictionary()


def tls_verify(ca_cert: Path | None) -> ssl.SSLContext:
    """The context httpx verifies an https controller with: httpx's own default (certifi, or SSL_CERT_FILE),
    and `ca_cert` too when given. A file that is not PEM certificates is an InvalidInput naming `ca-cert`."""
    context = httpx.create_ssl_context()
    if ca_cert is None:
        return context
    try:
        context.load_verify_locations(cafile=str(ca_cert))
    except (OSError, ssl.SSLError) as exc:
        raise InvalidInput(
            f"--ca-cert: cannot load {ca_cert} as PEM certificates ({exc})", field="ca-cert"
        ) from None
    return context


def bearer(token: str | None) -> dict[str, str]:
    """The `Authorization` header for `token` (none without one). A token that is not all visible ASCII (a stray
    newline from a file or a variable) is an InvalidInput naming `token`, never said back: it is a secret."""
    if not token:
        return {}
    if not TOKEN_TEXT.fullmatch(token):
        raise InvalidInput("token: only visible ASCII characters, no spaces or line breaks (a stray newline "
                           "from a file or a variable?)", field="token")  # fmt: skip
    return {"Authorization": f"Bearer {token}"}


def async_client(
    *, ca_cert: Path | None, transport: httpx.AsyncBaseTransport | None = None, **options: Any
) -> httpx.AsyncClient:
    """An httpx.AsyncClient trusting `ca_cert` (with `options` as httpx takes them), over `transport.py`'s
    HTTP/1.1 transport unless given another."""
    context = tls_verify(ca_cert)
    client = httpx.AsyncClient(verify=context, transport=transport or lean_transport(context), **options)
    if transport is None:  # a stand-in transport (tests) is reached only through httpx
        _contexts[client] = context
    return client


def context_of(client: httpx.AsyncClient) -> ssl.SSLContext | None:
    """The TLS context `client` was made with by `async_client`; None for one made otherwise."""
    return _contexts.get(client)
