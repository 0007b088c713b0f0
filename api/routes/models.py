"""`GET /v1/models`: the models this deployment serves, as OpenAI lists them."""

from __future__ import annotations

from fastapi import APIRouter

from api.capabilities import check_model
from api.deps import ResourcesDep, TenantDep
from api.schemas import ModelListPublic, ModelPublic

router = APIRouter(prefix="/v1/models", tags=["openai"])


@router.get("", response_model=ModelListPublic)
def list_models(tenant: TenantDep, resources: ResourcesDep) -> ModelListPublic:
    """Every served model (`settings.served_models`)."""
    created = int(resources.started_at)
    return ModelListPublic(
        data=[ModelPublic(id=name, created=created) for name in resources.settings.served_models]
    )


@router.get("/{model}", response_model=ModelPublic)
def read_model(model: str, tenant: TenantDep, resources: ResourcesDep) -> ModelPublic:
    """One served model; 404 model_not_found otherwise."""
    check_model(model, resources.settings.served_models)
    return ModelPublic(id=model, created=int(resources.started_at))
