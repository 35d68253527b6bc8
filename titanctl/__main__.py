"""`python -m titanctl`: the binary, as torchrun launches it."""

from titanctl.cli.app import main

if __name__ == "__main__":  # process-based async checkpointing re-imports this module
    main()
