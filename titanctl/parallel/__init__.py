"""How a recipe becomes sharded modules (``layouts/``), the model converters applied before (``converters/``),
and the distributed runtime kept apart (``runtime/``)."""
