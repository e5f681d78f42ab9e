"""`python -m rawserve`: the command line lives in rawserve.main."""

from rawserve.main import main

if __name__ == "__main__":
    raise SystemExit(main())
