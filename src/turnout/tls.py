"""Trusting an https controller, and the HTTP clients that do: the system's CAs, plus a private CA's PEM.

Workers and the CLI take `--ca-cert PATH` (the SDK `ca_cert=`, and `TURNOUT_CA_CERT` for all three), so a
controller with a certificate from a private CA (`--tls-cert`, `--tls-key`) is verified, never trusted
blindly. `async_client` makes the httpx client the SDK and the worker use (over `transport.py`), and remembers its TLS context,
so a file download can stream over a connection of its own with the same trust (`files.download`). Where the
environment names a proxy (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`, with `NO_PROXY`), the client is httpx's own,
which speaks to proxies as the environment says, and a download goes through it too.
"""

from __future__ import annotations

import re
import ssl
import urllib.request
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
    HTTP/1.1 transport unless given another, or a proxy is to be taken from the environment (httpx's then)."""
    context = tls_verify(ca_cert)
    if (
        transport is not None
    ):  # a stand-in transport (tests): reached only through httpx, its trust unknown here
        return httpx.AsyncClient(verify=context, transport=transport, **options)
    proxied = options.get("trust_env", True) and proxied_by_environment()
    client = httpx.AsyncClient(
        verify=context, transport=None if proxied else lean_transport(context), **options
    )
    _contexts[client] = context
    return client


def proxied_by_environment() -> bool:
    """Whether httpx takes a proxy from the environment (as `urllib.request.getproxies` reads it, as httpx
    does) for http or https: a client then needs httpx's own transport, which mounts it."""
    proxies = urllib.request.getproxies()
    return any(proxies.get(scheme) for scheme in ("http", "https", "all"))


def context_of(client: httpx.AsyncClient) -> ssl.SSLContext | None:
    """The TLS context `client` was made with by `async_client`; None for one made otherwise."""
    return _contexts.get(client)
