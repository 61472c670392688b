"""What every request handler needs, built once per gateway app: the caller's tenant, its
request body (size-limited), a started generation, and the response headers both APIs send.

The generation endpoints authenticate in two steps (`begin_auth`, then `confirm_auth` before
`start_generation`): a token whose lookup the tenant store holds (tracked, exact) is answered at
once; otherwise its lookup travels to Redis while the body is read, decoded and tokenised (for a
token that authenticated within the last `tenant_cache_s`; others are checked first), and an
authentication error still wins over any other (`PendingAuth.first_error`).

Response headers of an admitted request (`response_headers`): the generation's own
(`x-edgeserve-request-id`, worker tag, route), OpenAI's `x-ratelimit-*` figures where
the tenant has quotas (`quotas.rate_limit_headers`), and, when the tenant's tokens per
day lowered `max_tokens`, `x-edgeserve-quota-capped-max-tokens: <granted>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from backend.errors import PermissionDenied, PromptTooLong
from backend.sampling_params import SamplingParams
from gateway.config import GatewayConfig
from gateway.generation import Generation
from gateway.metering import Meter
from gateway.metrics import GatewayMetrics
from gateway.quotas import Quotas, rate_limit_headers
from gateway.router import Router
from gateway.served_models import ModelCatalog, ServedModel
from gateway.tenants import PendingAuth, Tenant, TenantStore
from gateway.worker_pool import WorkerPool

__all__ = ["GatewayState", "QUOTA_CAP_HEADER"]

QUOTA_CAP_HEADER = "x-edgeserve-quota-capped-max-tokens"


@dataclass
class GatewayState:
    config: GatewayConfig
    catalog: ModelCatalog
    router: Router
    pool: WorkerPool
    tenants: TenantStore
    quotas: Quotas
    meter: Meter
    metrics: GatewayMetrics

    async def tenant_of(self, request: Request) -> Tenant:
        """The caller's tenant (401 without a valid token); on an account path it must be that account (403)."""
        return await self.confirm_auth(self.begin_auth(request), request)

    def begin_auth(self, request: Request) -> PendingAuth:
        """The caller's token lookup, sent now (module docstring); a malformed header raises at once."""
        return self.tenants.begin(request.headers.get("authorization"))

    async def begin_auth_checked(self, request: Request) -> PendingAuth:
        """`begin_auth`, awaited now unless the token authenticated lately; the account path is checked
        against the tenant either way (403 before anything else)."""
        pending = self.begin_auth(request)
        _check_account(pending.tenant or await pending.confirm(), request)
        return pending

    async def confirm_auth(self, pending: PendingAuth, request: Request) -> Tenant:
        """The caller's tenant from its lookup; on an account path it must be that account (403)."""
        return _check_account(await pending.confirm(), request)

    async def start_generation(self, request: Request, api: str, tenant: Tenant, model: ServedModel,
                               prompt_ids: list[int], params: SamplingParams,
                               keep_special_ids: frozenset[int] = frozenset(), stream: bool = True) -> Generation:
        """Quota, route and worker admission for one request; typed refusals raise (nothing left behind).
        `keep_special_ids`: special tokens kept in the text for the response's parsers (`TextStream`);
        `stream=False` for a response read whole (`Generation.collect`).
        A prompt plus `max_tokens` over the model's context is refused here, before any quota is taken."""
        wanted = len(prompt_ids) + params.max_tokens
        if wanted > model.max_model_len:
            raise PromptTooLong(f"{model.name}'s context is {model.max_model_len} tokens; this request asks for "
                                f"{wanted} ({len(prompt_ids)} in the prompt, {params.max_tokens} for the completion)",
                                prompt_tokens=len(prompt_ids), max_tokens=params.max_tokens,
                                max_model_len=model.max_model_len)
        gen = Generation(tenant=tenant, model=model, prompt_ids=prompt_ids, params=params, api=api,
                         region=self.region_of(request), router=self.router, pool=self.pool,
                         quotas=self.quotas, meter=self.meter, metrics=self.metrics,
                         keep_special_ids=keep_special_ids, stream=stream)
        try:
            await gen.start()
        except BaseException:
            await gen.aclose()
            raise
        self.metrics.count_request(api, "200")
        return gen

    @staticmethod
    def response_headers(gen: Generation) -> dict[str, str]:
        """Headers for an admitted request's response (module docstring), on both APIs."""
        headers = {**gen.public_headers(), **rate_limit_headers(gen.tenant, gen.reservation)}
        if gen.capped_by_quota:
            headers[QUOTA_CAP_HEADER] = str(gen.params.max_tokens)
        return headers

    def region_of(self, request: Request) -> str:
        """The request's region: trusted edge headers, else this gateway's own (`regions.py`)."""
        return self.config.regions.request_region(request.headers, self.config.region)[0]

    async def body(self, request: Request) -> bytes:
        """The request body, refused (413) past the configured size before it is all read."""
        limit = self.config.max_request_bytes
        if int(request.headers.get("content-length") or 0) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)


def _check_account(tenant: Tenant, request: Request) -> Tenant:
    account = request.path_params.get("account_id")
    if account is not None and account != tenant.id:
        raise PermissionDenied("this API token cannot act on that account", account_id=account)
    return tenant


def _too_large(limit: int) -> PromptTooLong:
    return PromptTooLong(f"request body larger than {limit} bytes", max_request_bytes=limit)
