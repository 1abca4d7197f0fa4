"""Draft-phase iterations/s vs batch: `python bench/draft_phase.py [options]` == `graphcap bench [options]`."""
import sys

from graphcap.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
