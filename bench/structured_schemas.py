"""Ten JSON schemas of the kind extraction pipelines send, with a prompt and a valid example.

Nested objects, enums, arrays (with bounds), required fields and optional ones, numbers
with ranges, booleans. The benches use them; `example_document` builds one valid instance
of each (for walking a grammar token by token without a model).
"""

from __future__ import annotations

from typing import Any

SCHEMAS: list[dict[str, Any]] = [
    {  # 1: flat, required strings and an integer
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {  # 2: an enum and a boolean
        "type": "object",
        "properties": {
            "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "sarcastic": {"type": "boolean"},
        },
        "required": ["sentiment", "sarcastic"],
        "additionalProperties": False,
    },
    {  # 3: an array of strings, bounded
        "type": "object",
        "properties": {
            "keywords": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                         "maxItems": 5},
        },
        "required": ["keywords"],
        "additionalProperties": False,
    },
    {  # 4: a nested object
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "city": {"type": "string"},
        },
        "required": ["person", "city"],
        "additionalProperties": False,
    },
    {  # 5: an array of objects with an enum inside
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "size": {"type": "string", "enum": ["S", "M", "L"]},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "size", "quantity"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {  # 6: numbers and an optional field
        "type": "object",
        "properties": {
            "latitude": {"type": "number", "minimum": -90, "maximum": 90},
            "longitude": {"type": "number", "minimum": -180, "maximum": 180},
            "label": {"type": "string"},
        },
        "required": ["latitude", "longitude"],
        "additionalProperties": False,
    },
    {  # 7: two levels of nesting
        "type": "object",
        "properties": {
            "invoice": {
                "type": "object",
                "properties": {
                    "number": {"type": "string"},
                    "total": {
                        "type": "object",
                        "properties": {
                            "amount": {"type": "number"},
                            "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
                        },
                        "required": ["amount", "currency"],
                        "additionalProperties": False,
                    },
                },
                "required": ["number", "total"],
                "additionalProperties": False,
            },
        },
        "required": ["invoice"],
        "additionalProperties": False,
    },
    {  # 8: an array of integers and a nullable string
        "type": "object",
        "properties": {
            "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
            "comment": {"type": ["string", "null"]},
        },
        "required": ["scores", "comment"],
        "additionalProperties": False,
    },
    {  # 9: a classification with a confidence
        "type": "object",
        "properties": {
            "label": {"type": "string", "enum": ["spam", "ham"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "reasons": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        },
        "required": ["label", "confidence", "reasons"],
        "additionalProperties": False,
    },
    {  # 10: an event with nested attendees
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "date": {"type": "string"},
            "attendees": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "role": {"type": "string", "enum": ["host", "guest"]},
                    },
                    "required": ["name", "role"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["title", "date", "attendees"],
        "additionalProperties": False,
    },
]

PROMPTS = [
    "Extract the person: Alice Smith is 31 years old.",
    "Classify the sentiment of: 'What a lovely day, said nobody in the rain.'",
    "List keywords for: The quick brown fox jumps over the lazy dog.",
    "Extract the person and city: Ada Lovelace lived in London.",
    "Extract the order: two medium t-shirts TS-1 and one large hoodie HD-9.",
    "Give the coordinates of Paris.",
    "Extract the invoice: Invoice INV-42, total 99.50 euros.",
    "Give three scores out of ten for a film and a short comment.",
    "Is this spam? 'You won a free cruise, click here.'",
    "Describe a team meeting on 2026-12-01 hosted by Bo with guest Cy.",
]

_EXAMPLES: list[Any] = [
    {"name": "Alice Smith", "age": 31},
    {"sentiment": "negative", "sarcastic": True},
    {"keywords": ["fox", "dog"]},
    {"person": {"first": "Ada", "last": "Lovelace"}, "city": "London"},
    {"items": [{"sku": "TS-1", "size": "M", "quantity": 2}]},
    {"latitude": 48.85, "longitude": 2.35},
    {"invoice": {"number": "INV-42", "total": {"amount": 99.5, "currency": "EUR"}}},
    {"scores": [7, 8, 6], "comment": None},
    {"label": "spam", "confidence": 0.97, "reasons": ["prize"]},
    {"title": "Team meeting", "date": "2026-12-01",
     "attendees": [{"name": "Bo", "role": "host"}, {"name": "Cy", "role": "guest"}]},
]


def example_document(schema: dict[str, Any]) -> Any:
    """A valid instance of one of SCHEMAS."""
    return _EXAMPLES[SCHEMAS.index(schema)]
