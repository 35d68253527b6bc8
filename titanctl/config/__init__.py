"""The one declarative config: JobConfig dataclasses (every field with its help), TOML recipes with
``--section.key`` overrides, validation, and which keys each subcommand reads."""
