"""What this deployment serves and supports: a 4xx naming the field otherwise.

Shape errors (wrong type, out of range, unknown field, invalid text) are pydantic's, a
400; here are the requests that parse but ask for something the engine does not do, or
do not fit the model's context (400, the rules of `core.request_checks`, which batch
lines pass too), and models this deployment does not serve (404).
"""

from __future__ import annotations

from api.errors import InvalidRequest, NotFound
from api.resources import Resources
from core import request_checks, structured_outputs
from core.model_context import model_contexts
from core.request_checks import RequestRefused
from core.requests import AnyRequest, JobCreate

# Longest prompt (characters, all messages together) whose tokens are counted on the event
# loop: a few hundred microseconds at most, less than a hand-off to the thread pool costs
# in CPU; longer prompts are counted on the pool, so they hold no other request up.
MAX_PROMPT_CHARS_ON_LOOP = 4096


def refused(error: RequestRefused) -> InvalidRequest:
    """The 400 for a request the shared checks refused."""
    return InvalidRequest(error.message, param=error.param, code=error.code)


def check_supported(request: AnyRequest) -> None:
    """Refuse (InvalidRequest, naming the field) what parses but this service cannot do.

    `stream` is for the OpenAI-compatible endpoints, which relay the tokens; a job is
    followed with GET /v1/jobs/{id}/events instead.
    """
    try:
        request_checks.check_supported(request, can_stream=not isinstance(request, JobCreate))
    except RequestRefused as e:
        raise refused(e) from e


def check_request(request: AnyRequest, resources: Resources) -> None:
    """Supported, served, and within the model's context: else 400 or 404 naming the field.

    The context is read from the model's directory when this machine has it (under
    `models_dir`, or where its workers' card says they loaded it), tokenizing the prompt
    as the worker will; otherwise only the shape and support checks apply and the worker
    judges the length.
    """
    settings = resources.settings
    check_supported(request)
    check_model(request.model, settings.served_models)
    contexts = model_contexts(settings.models_dir)
    context = contexts.get(request.model)
    if context is None:
        card = resources.cards.get(request.model)
        path = (card or {}).get("path")
        context = contexts.get(request.model, announced_dir=path if isinstance(path, str)
                               else None)
    try:
        request_checks.check_context(request, context)
    except RequestRefused as e:
        raise refused(e) from e


def can_check_without_io(request: AnyRequest, resources: Resources) -> bool:
    """Whether check_request can run on the event loop: no file, Redis or DNS to wait for.

    True when the model is not served (a 404 from the settings) or its context is already
    loaded, and the prompt is short enough (MAX_PROMPT_CHARS_ON_LOOP) that counting its
    tokens costs less than handing it to a thread, or fits by its length alone (then it is
    not counted at all). A request with a `callback_url`
    (its host is resolved) is left to the thread pool by the caller.
    """
    if request.model not in resources.settings.served_models:
        return True
    if not structured_outputs.is_library_loaded() and structured_outputs.constrains_output(
            request.model_dump(include={"response_format", "tool_choice"})):
        return False  # the first schema check imports the grammar library: seconds
    context = model_contexts(resources.settings.models_dir).loaded(request.model)
    if context is None:
        return False
    messages = getattr(request, "messages", None)
    if messages:
        return sum(len(m.text) for m in messages) <= MAX_PROMPT_CHARS_ON_LOOP
    prompt = getattr(request, "prompt", None) or ""
    return (len(prompt) <= MAX_PROMPT_CHARS_ON_LOOP
            or context.surely_fits({"prompt": prompt}, request.num_max_tokens))


def check_model(model: str, served_models: list[str]) -> None:
    """404 model_not_found (as OpenAI answers) unless this deployment serves `model`."""
    if model not in served_models:
        raise NotFound(
            f"The model '{model}' does not exist; this deployment serves "
            f"{', '.join(repr(m) for m in served_models)} (see GET /v1/models).",
            param="model", code="model_not_found")
