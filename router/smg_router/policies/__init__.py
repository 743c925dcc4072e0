"""policies: the routing policies behind one interface, one factory and one registry (no aiohttp imports)."""
