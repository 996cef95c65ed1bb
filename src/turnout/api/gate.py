"""Submissions over a tenant's rate, refused at the door: before the body is read, parsed or validated.

A client that ignores Retry-After sends submission after submission; each refused one used to cost a whole
request's handling (body, JSON, pydantic, the token check) on the controller's one event loop, which every
other tenant's requests share. `SubmitGate` answers `POST /v1/tasks` from a tenant whose token it has seen in
the last few seconds (the token cache, no database) with the very 429 the route would answer, when the
route's answer could not be anything else (`tenancy.early_refusal`). Anything it is unsure of (an unknown
or bad token, a role that may not submit, a tenant within its rate) goes to the route, which decides as
before; the gate takes no token, so a request it lets through is admitted exactly as without it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from turnout.access import ANONYMOUS_OPERATOR, Action, allow
from turnout.api.errors import error_response
from turnout.api.service import Service
from turnout.errors import TurnoutError
from turnout.tenancy import early_refusal

GATED_PATH = "/v1/tasks"  # one task a request: a batch's refusal would depend on its size, read from its body


class SubmitGate:
    """ASGI middleware: the route's own 429 for a single submission over `submit_per_s`, body unread."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == GATED_PATH:
            tenant = self._submitting_tenant(scope)
            if tenant is not None:
                refusal = early_refusal(self.service.submissions, self.service.gpu_submissions, tenant)
                if refusal is not None:
                    # the unread body is the server's to discard; the connection stays open for the next request
                    await error_response(await self.service.paced(tenant, refusal))(scope, receive, send)
                    return
        await self.app(scope, receive, send)

    def _submitting_tenant(self, scope: Scope) -> str | None:
        """The tenant this request submits for, if its token is cached and may submit; else None (unsure)."""
        if not self.service.auth:
            return ANONYMOUS_OPERATOR.home_tenant
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None:
            return None
        try:
            principal = self.service.tokens.cached(header.decode("latin-1"))
            return None if principal is None else allow(principal, Action.SUBMIT).home_tenant
        except TurnoutError:
            return None  # a bad token or a role that may not submit: the route says which, as before
