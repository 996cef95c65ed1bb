"""Escalation: tasks that waited `after_s` with no local capacity go to a configured cloud endpoint.

    escalation:
      after_s: 30
      endpoints:
        - {capability: classify_text, kind: runpod, url: "https://api.runpod.ai/v2/ID", api_key_env: RUNPOD_API_KEY,
           price_per_s: 0.0019}
        - {capability: embed, kind: http, url: "https://models.example/embed", price_per_s: 0.001}

Kinds:
- `runpod`: a queue-based serverless endpoint. `POST {url}/run` with `{"input": ...}` and `Authorization: Bearer
  KEY` answers a job id; `GET {url}/status/{id}` answers IN_QUEUE, IN_PROGRESS, COMPLETED (with `output`),
  FAILED, CANCELLED or TIMED_OUT; `POST {url}/cancel/{id}` stops it. A result expires 30 minutes after it
  completes, so status is polled every `poll_s` and the output fetched at once. 429 means back off: the
  `Retry-After` it gives, else doubling from `poll_s`.
- `http`: `POST {url}` with `{"input": ...}` answers the output as JSON (200), or an error (4xx/5xx).

Which tasks go (`eligible`) is a pure decision; the loop that sends and polls (`Escalator`) lives in the API
process beside the controller, and keeps its remote job id on the task (`routing.cloud_job`), so a controller
restart resumes polling instead of sending the task twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from turnout.errors import InvalidInput
from turnout.models import GpuMode, check_capability_name

KINDS = ("runpod", "http")
ENDPOINT_KEYS = ("capability", "kind", "url", "api_key_env", "price_per_s", "name", "poll_s", "timeout_s")
# a cloud endpoint is a GPU: only tasks whose gpu value allows a GPU go there
ESCALATES = frozenset({GpuMode.PREFER, GpuMode.REQUIRE, GpuMode.AUTO})


@dataclass(frozen=True)
class Endpoint:
    capability: str
    kind: str
    url: str
    name: str
    api_key: str | None = field(default=None, repr=False)
    price_per_s: float | None = None
    poll_s: float = 1.0
    timeout_s: float = 600.0  # a job not finished by then is cancelled and its task fails `timeout`


@dataclass(frozen=True)
class EscalationSettings:
    after_s: float = 30.0
    endpoints: tuple[Endpoint, ...] = ()

    def endpoint_for(self, capability: str) -> Endpoint | None:
        return next((e for e in self.endpoints if e.capability == capability), None)

    def by_name(self, name: str) -> Endpoint | None:
        return next((e for e in self.endpoints if e.name == name), None)


def parse_escalation(
    raw: Any, source: str = "escalation", *, environ: Mapping[str, str] | None = None
) -> EscalationSettings | None:
    """The `escalation:` section; every error names the key. An `api_key_env` that is not set is an error now,
    at start, not a 401 on the first task an hour later."""
    if raw is None:
        return None
    env = environ or {}
    if not isinstance(raw, Mapping):
        raise InvalidInput(f"{source}: expected a mapping with after_s and endpoints", field=source)
    unknown = sorted(set(raw) - {"after_s", "endpoints"})
    if unknown:
        raise _bad(f"{source}.{unknown[0]}", "unknown key (known: after_s, endpoints)")
    after_s = _positive(raw.get("after_s", 30.0), f"{source}.after_s", zero_ok=True)
    items = raw.get("endpoints", [])
    if not isinstance(items, list):
        raise _bad(f"{source}.endpoints", "expected a list of endpoints")
    endpoints: list[Endpoint] = []
    for i, item in enumerate(items):
        at = f"{source}.endpoints.{i}"
        if not isinstance(item, Mapping):
            raise _bad(at, "expected a mapping (capability, kind, url, ...)")
        bad = sorted(set(item) - set(ENDPOINT_KEYS))
        if bad:
            raise _bad(f"{at}.{bad[0]}", f"unknown key (known: {', '.join(ENDPOINT_KEYS)})")
        for key in ("capability", "kind", "url"):
            if key not in item:
                raise _bad(f"{at}.{key}", "missing")
        capability = check_capability_name(item["capability"], f"{at}.capability")
        kind = item["kind"]
        if kind not in KINDS:
            raise _bad(f"{at}.kind", f"expected one of {', '.join(KINDS)}, got {kind!r}")
        url = item["url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise _bad(f"{at}.url", f"expected an http:// or https:// URL, got {url!r}")
        key_env = item.get("api_key_env")
        api_key = None
        if key_env is not None:
            if not isinstance(key_env, str) or not key_env:
                raise _bad(f"{at}.api_key_env", f"expected an environment variable name, got {key_env!r}")
            api_key = env.get(key_env)
            if not api_key:
                raise _bad(f"{at}.api_key_env", f"the environment variable {key_env} is not set")
        price = item.get("price_per_s")
        if price is not None:
            price = _positive(price, f"{at}.price_per_s", zero_ok=True)
        name = item.get("name", f"{kind}-{capability}")
        if not isinstance(name, str) or not name or len(name) > 32:
            raise _bad(f"{at}.name", f"expected a name of 1 to 32 characters, got {name!r}")
        if any(e.name == name for e in endpoints):
            raise _bad(f"{at}.name", f"{name!r} names another endpoint too")
        if any(e.capability == capability for e in endpoints):
            raise _bad(f"{at}.capability", f"{capability!r} already has an endpoint")
        endpoints.append(Endpoint(capability, kind, url.rstrip("/"), name, api_key, price,
                                  _positive(item.get("poll_s", 1.0), f"{at}.poll_s"),
                                  _positive(item.get("timeout_s", 600.0), f"{at}.timeout_s")))  # fmt: skip
    return EscalationSettings(after_s, tuple(endpoints))


def _positive(value: Any, at: str, *, zero_ok: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        raise _bad(at, f"expected a number {'>=' if zero_ok else '>'} 0, got {value!r}")
    return float(value)


def _bad(at: str, why: str) -> InvalidInput:
    return InvalidInput(f"{at}: {why}", field=at)


def eligible(
    mode: GpuMode, waited_s: float, settings: EscalationSettings | None, capability: str
) -> Endpoint | None:
    """The endpoint a queued task goes to now, or None: it must allow a GPU and have waited `after_s`."""
    if settings is None or mode not in ESCALATES or waited_s < settings.after_s:
        return None
    return settings.endpoint_for(capability)
