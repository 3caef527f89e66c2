"""``python -m bench.peers``: see :mod:`bench.peers`."""

from bench.peers.runner import main

if __name__ == "__main__":
    main()
