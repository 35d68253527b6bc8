"""Llama 3.x: the shared decoder (``titanctl.models.common``) with Meta's layout and flavors.
Its spec is ``titanctl.models.llama.spec.SPEC``."""
