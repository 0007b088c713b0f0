"""`GET /v1/models`: the models this deployment serves, as OpenAI lists them.

Which models are served, and their kinds, are settings (the API never loads a model);
context length and weights revision come from the cards workers announce in Redis, and
each model's state and live workers from what its workers record there (see
storage.model_states), read fresh on every listing.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from api.capabilities import check_model
from api.deps import ResourcesDep, TenantDep
from api.resources import Resources
from api.schemas import ModelListPublic, ModelPublic
from storage.model_cards import read_cards
from storage.model_states import ModelStatus

router = APIRouter(prefix="/v1/models", tags=["openai"])


@router.get("", response_model=ModelListPublic)
async def list_models(tenant: TenantDep, resources: ResourcesDep) -> ModelListPublic:
    """Every served model (`settings.served_models`), with kind, context and revision."""
    cards = await run_in_threadpool(_cards, resources)
    statuses = await resources.model_states.read(fresh=True)
    return ModelListPublic(data=[_model_public(name, resources, cards.get(name),
                                               statuses.get(name))
                                 for name in resources.settings.served_models])


# `:path`: served names and model paths hold slashes (`Qwen/Qwen2.5-0.5B`).
@router.get("/{model:path}", response_model=ModelPublic)
async def read_model(model: str, tenant: TenantDep, resources: ResourcesDep) -> ModelPublic:
    """One served model; 404 model_not_found otherwise."""
    check_model(model, resources.settings.served_models)
    cards = await run_in_threadpool(_cards, resources)
    statuses = await resources.model_states.read(fresh=True)
    return _model_public(model, resources, cards.get(model), statuses.get(model))


def _cards(resources: Resources) -> dict[str, dict[str, Any]]:
    return read_cards(resources.redis, prefix=resources.settings.topic_prefix)


def _model_public(name: str, resources: Resources, card: dict[str, Any] | None,
                  status: ModelStatus | None) -> ModelPublic:
    card = card or {}
    is_embedding = name in resources.settings.embedding_models
    context_length = card.get("context_length")
    return ModelPublic(
        id=name,
        created=int(resources.started_at),
        kind="embedding" if is_embedding else "chat",
        context_length=context_length if isinstance(context_length, int) else None,
        revision=card.get("revision") if isinstance(card.get("revision"), str) else None,
        state=None if status is None else status.state.value,
        live_workers=None if status is None else status.num_live_workers,
        error=None if status is None else status.error,
    )
