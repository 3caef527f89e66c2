"""``python -m edgecache.clients.cli``: how tests and the demo start nodes."""

from edgecache.clients.cli import main

main()
