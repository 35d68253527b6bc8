"""Print the config reference table that README.md embeds (`python scripts/config_reference.py`)."""

from titanctl.config.loader import reference_table

if __name__ == "__main__":
    print(reference_table())
