"""``python -m pipeplan ...`` (and ``torchrun -m pipeplan run plan.json``)."""

from pipeplan.cli import main

if __name__ == "__main__":
    main()
